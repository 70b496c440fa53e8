//! A step's values on the device, read by the host together.

use std::ops::Range;

use tch::{Device, Kind, Tensor};

use crate::error::TrainError;

/// The values a training step computes on the device and the host needs (the scaler's
/// found-inf flags, the gradient norm, the micro-batches' losses), gathered so that they
/// cross to the host in one copy: on a GPU, one wait for the device per step instead of one
/// per value, each of which would leave the device idle until the host queues more work.
#[derive(Default)]
pub(super) struct DeviceReads {
    parts: Vec<Tensor>,
    len: usize,
}

impl DeviceReads {
    /// Adds every element of `values` (any shape, any floating or integer kind; as `f64`)
    /// and returns where [`Self::read`]'s result will hold them. Nothing waits here.
    pub(super) fn add(&mut self, values: &Tensor) -> Result<Range<usize>, TrainError> {
        let flat = values.detach().f_reshape([-1])?.f_to_kind(Kind::Double)?;
        let at = self.len..self.len + flat.numel();
        self.len = at.end;
        self.parts.push(flat);
        Ok(at)
    }

    /// [`Self::add`] for one-element tensors: where the value will be.
    pub(super) fn add_one(&mut self, value: &Tensor) -> Result<usize, TrainError> {
        let at = self.add(value)?;
        debug_assert_eq!(at.len(), 1, "add_one takes a one-element tensor");
        Ok(at.start)
    }

    /// Every value added, in order: the parts joined on the first part's device (others are
    /// copied there, device to device), then one copy to the host.
    pub(super) fn read(self) -> Result<Vec<f64>, TrainError> {
        let Some(device) = self.parts.first().map(Tensor::device) else {
            return Ok(Vec::new());
        };
        let parts = self
            .parts
            .iter()
            .map(|t| t.f_to_device(device))
            .collect::<Result<Vec<_>, _>>()?;
        let joined = Tensor::f_cat(&parts, 0)?.f_to_device(Device::Cpu)?;
        Ok(Vec::<f64>::try_from(&joined)?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_of_every_shape_and_kind_come_back_in_order() {
        read_in_order(Device::Cpu, Device::Cpu);
    }

    /// The same with the values on cuda:0 (a half-precision loss among them) and one on the
    /// CPU, as a training step on a GPU adds them. `cargo xtask gpu-check` runs it; without
    /// a GPU it says `skipped:`.
    #[test]
    fn values_of_every_shape_and_kind_come_back_in_order_on_cuda() {
        if crate::ddp::gpu_tests::gpu() {
            read_in_order(Device::Cuda(0), Device::Cpu);
        }
    }

    /// Values of every shape and kind on `device`, the count on `other`, read in order.
    fn read_in_order(device: Device, other: Device) {
        let on = |t: Tensor| t.to_device(device);
        let mut reads = DeviceReads::default();
        let flags = reads.add(&on(Tensor::from_slice(&[0.0f32, 1.0]))).unwrap();
        let norm = reads.add_one(&on(Tensor::from(2.5f32))).unwrap();
        let loss = reads
            .add_one(&on(Tensor::from_slice(&[0.1f32]).reshape([1, 1])))
            .unwrap();
        let count = reads.add_one(&Tensor::from(7i64).to_device(other)).unwrap();
        let nan = reads.add_one(&on(Tensor::from(f32::NAN))).unwrap();
        let half = reads
            .add_one(&on(Tensor::from(0.1f32).to_kind(Kind::Half)))
            .unwrap();
        assert_eq!((flags, norm, loss, count, nan, half), (0..2, 2, 3, 4, 5, 6));
        let values = reads.read().unwrap();
        assert_eq!(values.len(), 7);
        // Half's nearest value to 0.1, exactly.
        assert_eq!(values[half], 0.0999755859375);
        assert_eq!(&values[..3], [0.0, 1.0, 2.5]);
        // The f32 value widened exactly, not 0.1 as an f64.
        assert_eq!(values[loss], f64::from(0.1f32));
        assert_eq!(values[count], 7.0);
        assert!(values[nan].is_nan());
    }

    #[test]
    fn nothing_added_reads_nothing() {
        assert_eq!(DeviceReads::default().read().unwrap(), Vec::<f64>::new());
    }
}
