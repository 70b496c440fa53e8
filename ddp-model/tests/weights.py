"""PyTorch side of ddp-model's weights test: writes every file the test reads.

Usage: weights.py DIR MARKER PYTHON_MARKER

Writes into DIR:
  dtypes.pth       every dtype with known values, a transposed tensor, three views of one
                   storage (offsets 2, 4 and 1 with stride 3), a Parameter, a 0-d tensor
  dtypes-p4.pt     the same with pickle protocol 4, saved as first.pt and renamed (its top
                   folder is `first`)
  big-endian.pth   f32, f16 and i64 tensors in a file whose byteorder is `big`
  cuda.pth         a tensor whose storage location is `cuda:0`
  convnet8.pth     the ConvNet of interop.py (8 classes), seeded; also convnet8.safetensors
                   saved under the extension `.bin` (convnet8.bin)
  convnet8-ddp.pth the same state_dict with DDP's `module.` prefix
  convnet8-compiled-ddp.pth  the state_dict of torch.compile(convnet8) (names `_orig_mod.`)
                   with DDP's prefix, as DDP(torch.compile(model)).state_dict() names them
  convnet1000.pth  the ConvNet with a 1000-class head
  wrong.pth        convnet8 with features.0.weight of shape [16, 3, 3, 3] and an extra name
  evil.pth         a torch.save archive whose data.pkl calls os.system('touch MARKER');
                   Python's own pickle runs the same payload on PYTHON_MARKER first, to
                   show that the file does what it says
  legacy.pt        the legacy (non-zip) format; legacy-p0.pt and legacy-p1.pt with pickle
                   protocols 0 and 1 (no PROTO opcode)
  float8-e8m0.pth  {"e8": a float8_e8m0fnu tensor}: a dtype tch has no kind for
  checkpoint.pth   a training checkpoint of convnet8: {"epoch": 3, "model": state_dict,
                   "optimizer": an SGD state_dict with momentum buffers}
  two-models.pth   {"model": convnet8, "ema": convnet8 with its floats doubled, "epoch": 3}
  averaged.pth     the state_dict of AveragedModel(ConvNet()) with random parameters: its
                   names under `module.`, and `n_averaged` without it
  not-a-state-dict.pth  {"epoch": 3, "weights": [a tensor]}: no entry is a state_dict
  short-record.pth a tensor of 4 floats whose storage record holds 2
  past-storage.pth a tensor of 4 floats whose storage claims 2 elements
  resnet18-ddp.pth torchvision's resnet18(num_classes=8) state_dict with DDP's prefix, and
                   resnet18.safetensors, the same tensors by safetensors
  resnet18-legacy.pth  the same state_dict without its num_batches_tracked counters, as
                   torchvision's ImageNet ResNet files were saved
  neg-conj.pth     tensors saved with their lazy neg or conj bit: {'neg': True} metadata
  expanded-neg.pth {"w": torch.ones(1).expand(2**33)._neg_view()}: 2**33 elements, one stored
  resized-storage.pth {"a": ones(1), "b": ones(2)}, b's storage renamed to a's and said
                   to hold 2**31 - 1 elements
  many-negations.pth ten lazily negated views of one 20 MiB storage
  deep.pth         a torch.save archive whose data.pkl is a tuple nested 1 000 000 deep
  many-entries.pth {"entry0": 0, ..., "entry19": 19}
  namespace.pth    {"model": convnet8, "args": argparse.Namespace(lr=0.1)}, as the
                   torchvision reference scripts save
  no-crc.pth       convnet8 saved with set_crc32_options(False): every record's CRC is 0
  bad-crc.pth      a copy of convnet8.pth with one byte of a record changed, its CRC kept
  xla.pth          convnet8 as an XLA device saves it: each tensor a CPU copy rebuilt by
                   _rebuild_device_tensor_from_cpu_tensor(cpu, dtype, "xla:0", False)
  xla-f64.pth      {"w": float32 [1.5, -2.25]} saved so, but with the dtype float64
  extras.pth       {"model": convnet8} and values weights_only allows: a torch.device, a
                   Counter, a complex, a bytearray, ints wider than 64 bits
  deflated.pth     a tensor of 4 floats whose storage record is deflated: 64 KiB of
                   the file that inflate to 64 MiB
  long-record.pth  a tensor of 4 floats whose storage record holds 20 bytes, its headers
                   declaring 16
  declared-short.pth  the same whose record holds 16 bytes, its headers declaring 8
"""
import argparse
import os
import pickle
import shutil
import struct
import sys
import zipfile
from collections import Counter, OrderedDict

import torch
from safetensors.torch import save_file

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from interop import ConvNet  # noqa: E402


def dtype_state():
    sd = OrderedDict()
    sd["f32"] = torch.tensor([1.5, -2.25, 3.0e-8, 65504.0], dtype=torch.float32)
    sd["f16"] = torch.tensor([[1.5, -2.25], [0.0009765625, 65504.0]], dtype=torch.float16)
    sd["bf16"] = torch.tensor([1.5, -2.25, 256.0, -0.0078125], dtype=torch.bfloat16)
    sd["f64"] = torch.tensor([1.0 / 3.0, -2.5, 1e300], dtype=torch.float64)
    sd["i64"] = torch.tensor([-(2**62), 7, -1, 2**40], dtype=torch.int64)
    sd["i32"] = torch.tensor([-(2**31), 2**31 - 1, 0], dtype=torch.int32)
    sd["i16"] = torch.tensor([-32768, 32767, 1], dtype=torch.int16)
    sd["i8"] = torch.tensor([-128, 127, 3], dtype=torch.int8)
    sd["u8"] = torch.tensor([0, 255, 128], dtype=torch.uint8)
    sd["bool"] = torch.tensor([True, False, True])
    sd["transposed"] = torch.arange(12, dtype=torch.float32).reshape(3, 4).t()
    base = torch.arange(10, dtype=torch.float32) * 10
    sd["view_a"] = base[2:5]
    sd["view_b"] = base[4:8]
    sd["view_strided"] = base[1::3]
    sd["param"] = torch.nn.Parameter(torch.tensor([0.25, 0.5]))
    sd["scalar"] = torch.tensor(42, dtype=torch.int64)
    sd._metadata = OrderedDict({"": {"version": 1}})
    return sd


def rewrite(path, records, deflated=()):
    """Rewrites a zip archive, replacing the named records' bytes (stored, like torch, but
    for the records named in `deflated`)."""
    with zipfile.ZipFile(path) as z:
        entries = [(n, z.read(n)) for n in z.namelist()]
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as z:
        for name, data in entries:
            method = zipfile.ZIP_DEFLATED if name in deflated else zipfile.ZIP_STORED
            z.writestr(name, records.get(name, data), compress_type=method)


def declare(path, name, size):
    """Changes the uncompressed size that record `name`'s local and central headers declare."""
    with zipfile.ZipFile(path) as z:
        local = z.getinfo(name).header_offset
        central = z.start_dir
    with open(path, "r+b") as f:
        data = bytearray(f.read())
        struct.pack_into("<I", data, local + 22, size)
        at = central
        while data[at + 46:at + 46 + len(name)] != name.encode():
            at = data.index(b"PK\x01\x02", at + 1)
        struct.pack_into("<I", data, at + 24, size)
        f.seek(0)
        f.write(data)


def lying_records(out):
    """Tensors of 4 floats (16 bytes) whose storage record is deflated, or longer or shorter
    than its headers declare."""
    for name, record, size in [("deflated", bytes(64 << 20), None),
                               ("long-record", bytes(20), 16),
                               ("declared-short", bytes(16), 8)]:
        path = os.path.join(out, f"{name}.pth")
        torch.save({"t": torch.zeros(4)}, path)
        key = f"{name}/data/0"
        rewrite(path, {key: record}, deflated=[key] if size is None else [])
        if size is not None:
            declare(path, key, size)
        with zipfile.ZipFile(path) as z:
            info = z.getinfo(key)
            assert (info.compress_type, info.file_size) == (
                (zipfile.ZIP_DEFLATED, 64 << 20) if size is None else (zipfile.ZIP_STORED, size)
            ), info


def big_endian(path):
    sd = OrderedDict()
    sd["f32"] = torch.tensor([1.5, -2.25, 3.0e-8], dtype=torch.float32)
    sd["f16"] = torch.tensor([1.5, -2.25], dtype=torch.float16)
    sd["i64"] = torch.tensor([-(2**62), 7], dtype=torch.int64)
    torch.save(sd, path)
    # Storages are keyed 0, 1, 2 in order of appearance; swap each element's bytes.
    prefix = os.path.splitext(os.path.basename(path))[0]
    records = {f"{prefix}/byteorder": b"big"}
    for key, t in enumerate(sd.values()):
        swapped = t.contiguous().numpy().byteswap().tobytes()
        records[f"{prefix}/data/{key}"] = swapped
    rewrite(path, records)
    back = torch.load(path, weights_only=True)
    for name, t in sd.items():
        assert torch.equal(back[name], t), f"torch reads the big-endian {name} differently"


def cuda_location(path):
    # torch.save asks location_tag for each storage's location; a CPU-only machine can still
    # write the file a GPU would.
    original = torch.serialization.location_tag
    torch.serialization.location_tag = lambda storage: "cuda:0"
    try:
        torch.save({"w": torch.tensor([[1.0, 2.0], [3.0, 4.0]])}, path)
    finally:
        torch.serialization.location_tag = original
    with zipfile.ZipFile(path) as z:
        assert b"cuda:0" in z.read("cuda/data.pkl")


def evil(path, marker, python_marker):
    torch.save({"weight": torch.zeros(1)}, path)

    def payload(target):
        cmd = f"touch {target}".encode()
        # {'weight': os.system(cmd)}, naming the global 'os system' as a pickle would.
        return (b"\x80\x02}q\x00X\x06\x00\x00\x00weightq\x01cos\nsystem\nq\x02X"
                + len(cmd).to_bytes(4, "little") + cmd + b"\x85q\x03Rq\x04s.")

    pickle.loads(payload(python_marker))
    assert os.path.exists(python_marker), "the payload does not run under Python's pickle"
    rewrite(path, {"evil/data.pkl": payload(marker)})
    try:
        torch.load(path, weights_only=True)
    except pickle.UnpicklingError as e:
        assert "system" in str(e), e
    else:
        raise AssertionError("torch.load(weights_only=True) accepted the payload")


def neg_conj(path):
    c = torch.tensor([1 + 2j, 3 - 4j])
    sd = {"neg_view": torch.tensor([2.0, -4.0])._neg_view(),
          "conj_imag": c.clone().conj().imag, "conj": c.clone().conj()}
    assert sd["neg_view"].is_neg() and sd["conj_imag"].is_neg() and sd["conj"].is_conj()
    torch.save(sd, path)
    with zipfile.ZipFile(path) as z:
        pkl = z.read("neg-conj/data.pkl")
    assert pkl.count(b"X\x03\x00\x00\x00neg") == 2 and b"X\x04\x00\x00\x00conj" in pkl, pkl
    back = torch.load(path, weights_only=True)
    assert back["neg_view"].tolist() == [-2.0, 4.0] and back["conj_imag"].tolist() == [-2.0, 4.0]
    assert back["conj"].resolve_conj().tolist() == [1 - 2j, 3 + 4j]


def expanded_neg(path):
    # One stored element viewed 2**33 times (stride 0), negated lazily: torch.load allocates
    # nothing for it.
    t = torch.ones(1).expand(2**33)._neg_view()
    assert t.is_neg() and t.stride() == (0,)
    torch.save({"w": t}, path)
    back = torch.load(path, weights_only=True)
    assert back["w"].is_neg() and back["w"].shape == (2**33,)


def resized_storage(path):
    # Two tensors, then the second's storage renamed to the first's with 2**31 - 1 elements
    # declared: one record named with two sizes.
    torch.save({"a": torch.ones(1), "b": torch.ones(2)}, path)
    with zipfile.ZipFile(path) as z:
        pkl = z.read("resized-storage/data.pkl")
    assert pkl.count(b"X\x01\x00\x00\x001") == 1 and pkl.count(b"K\x02t") == 1, pkl
    pkl = pkl.replace(b"X\x01\x00\x00\x001", b"X\x01\x00\x00\x000")
    rewrite(path, {"resized-storage/data.pkl": pkl.replace(b"K\x02t", b"J\xff\xff\xff\x7ft")})


def many_negations(path):
    # Ten lazily negated views of one 20 MiB storage: torch.load copies nothing, a loader
    # that applies each would copy 200 MiB.
    base = torch.zeros(5 << 20)
    torch.save({f"n{i}": base._neg_view() for i in range(10)}, path)
    with zipfile.ZipFile(path) as z:
        assert sum(n.startswith("many-negations/data/") for n in z.namelist()) == 1


def assert_loads_as(path, sd, **kwargs):
    back = torch.load(path, weights_only=True, **kwargs)
    back = back.get("model", back)
    assert list(back) == list(sd) and all(torch.equal(back[k], v) for k, v in sd.items())


def no_crc(sd, path):
    torch.serialization.set_crc32_options(False)
    try:
        torch.save(sd, path)
    finally:
        torch.serialization.set_crc32_options(True)
    with zipfile.ZipFile(path) as z:
        assert all(i.CRC == 0 for i in z.infolist()), "torch wrote CRCs"
    assert_loads_as(path, sd)


def bad_crc(src, path):
    shutil.copy(src, path)
    with zipfile.ZipFile(path) as z:
        info = z.getinfo("convnet8/data/0")
        assert info.CRC != 0 and info.compress_type == zipfile.ZIP_STORED
    with open(path, "r+b") as f:
        f.seek(info.header_offset + 26)
        lengths = f.read(4)
        at = info.header_offset + 30 + int.from_bytes(lengths[:2], "little") \
            + int.from_bytes(lengths[2:], "little")
        f.seek(at)
        byte = f.read(1)[0]
        f.seek(at)
        f.write(bytes([byte ^ 0x40]))
    with zipfile.ZipFile(path) as z:
        assert z.testzip() == "convnet8/data/0", "the change does not break the CRC"


def xla(sd, path, dtype=None):
    # An XLA tensor pickles as its CPU copy and the device's name (Tensor._reduce_ex_internal
    # for "xla", "maia" and "mtia"); a CPU-only machine can write the same file.
    ids = {id(t) for t in sd.values()}
    original = torch.Tensor._reduce_ex_internal

    def reduce_ex(self, proto):
        if id(self) not in ids:
            return original(self, proto)
        return (torch._utils._rebuild_device_tensor_from_cpu_tensor,
                (self.detach().clone(), dtype or self.dtype, "xla:0", self.requires_grad))

    torch.Tensor._reduce_ex_internal = reduce_ex
    try:
        torch.save(sd, path)
    finally:
        torch.Tensor._reduce_ex_internal = original
    prefix = os.path.splitext(os.path.basename(path))[0]
    with zipfile.ZipFile(path) as z:
        pkl = z.read(f"{prefix}/data.pkl")
    assert pkl.count(b"_rebuild_device_tensor_from_cpu_tensor") == 1 and b"xla:0" in pkl, pkl
    assert_loads_as(path, {k: v.to(dtype or v.dtype) for k, v in sd.items()}, map_location="cpu")


def extras(sd, path):
    torch.save({"model": sd, "device": torch.device("cuda", 0), "cpu": torch.device("cpu"),
                "counts": Counter(a=2), "z": 1 + 2j, "buf": bytearray(b"x"),
                "big": [2**70, -(2**70), 2**63]}, path)
    back = torch.load(path, weights_only=True)
    assert back["device"] == torch.device("cuda", 0) and back["counts"] == Counter(a=2)
    assert back["z"] == 1 + 2j and back["buf"] == bytearray(b"x")
    assert back["big"] == [2**70, -(2**70), 2**63]
    assert_loads_as(path, sd)


def main(out, marker, python_marker):
    torch.save(dtype_state(), os.path.join(out, "dtypes.pth"))
    first = os.path.join(out, "first.pt")
    torch.save(dtype_state(), first, pickle_protocol=4)
    os.rename(first, os.path.join(out, "dtypes-p4.pt"))
    big_endian(os.path.join(out, "big-endian.pth"))
    cuda_location(os.path.join(out, "cuda.pth"))

    torch.manual_seed(7)
    model = ConvNet()
    model.train()
    with torch.no_grad():
        model(torch.rand(4, 3, 32, 32))
    sd = model.state_dict()
    torch.save(sd, os.path.join(out, "convnet8.pth"))
    save_file(sd, os.path.join(out, "convnet8.bin"))
    torch.save(OrderedDict((f"module.{k}", v) for k, v in sd.items()),
               os.path.join(out, "convnet8-ddp.pth"))
    compiled = torch.compile(model).state_dict()
    assert next(iter(compiled)) == "_orig_mod.features.0.weight", next(iter(compiled))
    torch.save(OrderedDict((f"module.{k}", v) for k, v in compiled.items()),
               os.path.join(out, "convnet8-compiled-ddp.pth"))
    wrong = OrderedDict(sd)
    wrong["features.0.weight"] = torch.zeros(16, 3, 3, 3)
    wrong["extra.bias"] = torch.zeros(3)
    torch.save(wrong, os.path.join(out, "wrong.pth"))
    torch.manual_seed(8)
    torch.save(ConvNet(num_classes=1000).state_dict(), os.path.join(out, "convnet1000.pth"))

    evil(os.path.join(out, "evil.pth"), marker, python_marker)
    torch.save({"a": torch.ones(2)}, os.path.join(out, "legacy.pt"),
               _use_new_zipfile_serialization=False)
    for protocol in (0, 1):
        torch.save({"a": torch.ones(2)}, os.path.join(out, f"legacy-p{protocol}.pt"),
                   _use_new_zipfile_serialization=False, pickle_protocol=protocol)
    torch.save({"e8": torch.ones(3).to(torch.float8_e8m0fnu)},
               os.path.join(out, "float8-e8m0.pth"))
    torch.load(os.path.join(out, "float8-e8m0.pth"), weights_only=True)
    # state_dict() shares the model's storages: keep convnet8's values before the step.
    sd = OrderedDict((k, v.clone()) for k, v in sd.items())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.rand(2, 3, 32, 32)).sum().backward()
    optimizer.step()
    assert optimizer.state_dict()["state"], "the optimizer has no state to save"
    torch.save({"epoch": 3, "model": sd, "optimizer": optimizer.state_dict()},
               os.path.join(out, "checkpoint.pth"))
    ema = OrderedDict((k, v * 2 if v.is_floating_point() else v) for k, v in sd.items())
    torch.save({"model": sd, "ema": ema, "epoch": 3}, os.path.join(out, "two-models.pth"))
    # torchvision's reference training saves `--model-ema` weights as an AveragedModel's
    # state_dict: the model's names under `module.`, and `n_averaged` beside them.
    averaged = torch.optim.swa_utils.AveragedModel(ConvNet())
    with torch.no_grad():
        for p in averaged.module.parameters():
            p.copy_(torch.rand_like(p))
    averaged_sd = averaged.state_dict()
    assert "n_averaged" in averaged_sd and "module.features.0.weight" in averaged_sd, averaged_sd.keys()
    torch.save(averaged_sd, os.path.join(out, "averaged.pth"))
    torch.save({"epoch": 3, "weights": [torch.ones(2)]}, os.path.join(out, "not-a-state-dict.pth"))
    short = os.path.join(out, "short-record.pth")
    torch.save({"t": torch.zeros(4)}, short)
    rewrite(short, {"short-record/data/0": bytes(8)})
    past = os.path.join(out, "past-storage.pth")
    torch.save({"t": torch.zeros(4)}, past)
    with zipfile.ZipFile(past) as z:
        pkl = z.read("past-storage/data.pkl")
    assert pkl.count(b"K\x04t") == 1, pkl
    rewrite(past, {"past-storage/data.pkl": pkl.replace(b"K\x04t", b"K\x02t")})
    import torchvision
    torch.manual_seed(9)
    resnet = torchvision.models.resnet18(num_classes=8).state_dict()
    torch.save(OrderedDict((f"module.{k}", v) for k, v in resnet.items()),
               os.path.join(out, "resnet18-ddp.pth"))
    save_file(resnet, os.path.join(out, "resnet18.safetensors"))
    torch.save(OrderedDict((k, v) for k, v in resnet.items()
                           if not k.endswith("num_batches_tracked")),
               os.path.join(out, "resnet18-legacy.pth"))
    neg_conj(os.path.join(out, "neg-conj.pth"))
    expanded_neg(os.path.join(out, "expanded-neg.pth"))
    resized_storage(os.path.join(out, "resized-storage.pth"))
    many_negations(os.path.join(out, "many-negations.pth"))
    deep = os.path.join(out, "deep.pth")
    torch.save({"t": torch.zeros(1)}, deep)
    rewrite(deep, {"deep/data.pkl": b"\x80\x02)" + b"\x85" * 1_000_000 + b"."})
    torch.save({f"entry{i}": i for i in range(20)}, os.path.join(out, "many-entries.pth"))
    namespace = os.path.join(out, "namespace.pth")
    torch.save({"model": sd, "args": argparse.Namespace(lr=0.1)}, namespace)
    try:
        torch.load(namespace, weights_only=True)
    except pickle.UnpicklingError as e:
        assert "Namespace" in str(e), e
    else:
        raise AssertionError("torch.load(weights_only=True) accepted argparse.Namespace")
    no_crc(sd, os.path.join(out, "no-crc.pth"))
    bad_crc(os.path.join(out, "convnet8.pth"), os.path.join(out, "bad-crc.pth"))
    xla(sd, os.path.join(out, "xla.pth"))
    xla({"w": torch.tensor([1.5, -2.25])}, os.path.join(out, "xla-f64.pth"), torch.float64)
    extras(sd, os.path.join(out, "extras.pth"))
    lying_records(out)
    print("written")


if __name__ == "__main__":
    main(*sys.argv[1:4])
