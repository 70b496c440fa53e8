//! ODIR as a [`Dataset`]: each sample is an image file through a [`Transform`], with its
//! eight labels as targets.

use std::sync::Arc;

use super::dataset::OdirDataset;
use super::transform::{Pipeline, Transform};
use crate::dataset::Dataset;
use crate::error::DataError;
use crate::rng::SampleRng;
use crate::sample::{Input, SampleLayout, SampleOut};

/// The images of an [`OdirDataset`] through a [`Transform`]: `[3, size, size]` inputs and 8
/// multi-hot targets in N, D, G, C, A, H, M, O order. Writes bytes (for the GPU path, which
/// converts them on the device) or the transform's final `f32` values.
#[derive(Debug, Clone)]
pub struct OdirImages {
    set: Arc<OdirDataset>,
    transform: Transform,
}

impl OdirImages {
    /// `set`'s images through `transform`.
    pub fn new(set: Arc<OdirDataset>, transform: Transform) -> Self {
        Self { set, transform }
    }

    /// The underlying data set.
    pub fn set(&self) -> &Arc<OdirDataset> {
        &self.set
    }

    /// The transform every image goes through.
    pub fn transform(&self) -> &Transform {
        &self.transform
    }
}

impl Dataset for OdirImages {
    type Worker = Pipeline;

    fn len(&self) -> usize {
        self.set.len()
    }

    fn layout(&self) -> SampleLayout {
        let s = self.transform.output_size() as usize;
        SampleLayout::new([3, s, s], [8]).bytes(self.transform.affine())
    }

    fn worker(&self) -> Pipeline {
        Pipeline::new()
    }

    fn write(
        &self,
        pipeline: &mut Pipeline,
        index: usize,
        rng: &mut SampleRng,
        out: SampleOut<'_>,
    ) -> Result<(), DataError> {
        let sample = self.set.sample(index)?;
        match out.input {
            Input::U8(bytes) => pipeline.run_u8(&self.transform, &sample.path, rng, bytes)?,
            input => pipeline.run(&self.transform, &sample.path, rng, input.f32()?)?,
        }
        out.targets.f32()?.copy_from_slice(&sample.labels);
        Ok(())
    }

    fn describe(&self, index: usize) -> String {
        self.set.get(index).map_or_else(
            || format!("sample {index}"),
            |s| format!("'{}'", s.path.display()),
        )
    }
}
