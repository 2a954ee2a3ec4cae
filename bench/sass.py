"""What the compiler made of the decode kernels: ptxas's resource report and a SASS histogram.

Compiles each kernel once (one small shape) with Mosaic GPU's dump switches on, keeps the
dumps under ``--out`` and prints, per kernel, the registers / spills / stack that ptxas
reports, the count of the SASS opcodes that matter for this kernel (tensor-core ops,
shared-memory traffic, local memory = spills, conversions, special functions, shuffles,
barriers) and, for each loop of 100 instructions or more (the page loops), the instructions
a warp issues per iteration. The SASS comes from the cubin in Mosaic's MLIR dump, through ``cuobjdump``
(found on PATH or under /usr/local/cuda*/bin; the H200 image has it).

  python bench/sass.py --out DIR [--batch 8 --heads 128 --context 2048] [--only fp8-fp8,...]

``--offline`` compiles for a compile-only Hopper device instead (no GPU needed: ahead-of-time
compilation against ``HOPPER_TARGET_CONFIG``), in an environment with the CUDA plugin and
its libraries, whose version checks find no driver to check against::

  python -m venv /tmp/cuda && /tmp/cuda/bin/pip install "jax[cuda13]==0.11.2" flax chex
  JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1 JAX_PLATFORMS=cpu PYTHONPATH=. \
    /tmp/cuda/bin/python bench/sass.py --offline --out /tmp/sass --only fp8-fp8

(``make sass-offline`` does both.) Mosaic runs the first ``ptxas`` on PATH: CUDA 13.0's
(``/usr/local/bin`` here) reproduces the device's reports exactly, the 13.5 of the plugin's
``nvidia-cuda-nvcc`` wheel does not (the FP8 kernel: 724 B of spill stores against 36 B).
``cuobjdump`` and ``nvdisasm`` (their ``nvidia-cuda-*`` wheels) give the SASS.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import glob
import os
import re
import shutil
import subprocess
import sys

import jax

# XLA's GpuTargetConfig of an sm_90a device (H100 SXM figures; the code generated for the
# H200 is the same): what ahead-of-time compilation needs to know of the device.
HOPPER_TARGET_CONFIG = """
gpu_device_info {
  threads_per_block_limit: 1024 threads_per_warp: 32 shared_memory_per_block: 49152
  shared_memory_per_core: 233472 threads_per_core_limit: 2048 core_count: 132
  fpus_per_core: 128 block_dim_limit_x: 2147483647 block_dim_limit_y: 65535
  block_dim_limit_z: 65535 memory_bandwidth: 3352320000000 l2_cache_size: 52428800
  clock_rate_ghz: 1.98 device_memory_size: 84942979072 shared_memory_per_block_optin: 232448
  cuda_compute_capability { major: 9 } registers_per_core_limit: 65536
  registers_per_block_limit: 65536
}
platform_name: "CUDA"
dnn_version_info { major: 9 minor: 10 }
device_description_str: "NVIDIA H100 80GB HBM3"
"""

WATCH = ("HGMMA", "QGMMA", "WARPGROUP", "LDSM", "STSM", "LDS", "STS", "LDL", "STL", "LDG",
         "STG", "UTMALDG", "SYNCS", "BAR", "SHFL", "MUFU", "F2FP", "F2F", "I2F", "F2I", "PRMT",
         "LOP3", "FMUL", "FFMA", "FADD", "FMNMX", "FSETP", "ISETP", "IMAD", "BRA")


@contextlib.contextmanager
def capture_fds(path: str):
  """Sends file descriptors 1 and 2 (what C++ code prints too) to ``path`` meanwhile."""
  sys.stdout.flush()
  sys.stderr.flush()
  saved = [os.dup(1), os.dup(2)]
  with open(path, "w") as sink:
    os.dup2(sink.fileno(), 1)
    os.dup2(sink.fileno(), 2)
    try:
      yield
    finally:
      sys.stdout.flush()
      sys.stderr.flush()
      os.dup2(saved[0], 1)
      os.dup2(saved[1], 2)
      for fd in saved:
        os.close(fd)


def compile_only_sharding():
  """A sharding on a compile-only sm_90a device (``HOPPER_TARGET_CONFIG``)."""
  from jax.experimental import topologies
  topology = topologies.get_topology_desc(platform="cuda", topology_name="",
                                          target_config=HOPPER_TARGET_CONFIG, topology="1x1x1")
  return jax.sharding.SingleDeviceSharding(topology.devices[0])


def extract_cubin(text: str) -> bytes | None:
  """The last ``gpu.binary``'s ``bin = "..."`` in an MLIR dump, as bytes (LLVM's escaping:
  a backslash doubled, quotes and non-printable bytes as ``\\XX``)."""
  start = text.rfind('bin = "')
  if start < 0:
    return None
  out, i = bytearray(), start + len('bin = "')
  while text[i] != '"':
    if text[i:i + 2] == "\\\\":
      out.append(ord("\\"))
      i += 2
    elif text[i] == "\\":
      out.append(int(text[i + 1:i + 3], 16))
      i += 3
    else:
      out += text[i].encode("latin-1")
      i += 1
  return bytes(out)


def disassemble(cubin_path: str) -> str:
  tool = shutil.which("cuobjdump") or next(iter(sorted(glob.glob("/usr/local/cuda*/bin/cuobjdump"))),
                                          None)
  if tool is None:
    return ""
  return subprocess.run([tool, "--dump-sass", cubin_path], capture_output=True, text=True).stdout


_INSTRUCTION = re.compile(r"\s*/\*([0-9a-f]+)\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)"
                          r"(?:\.[A-Z0-9_.]+)?(?:\s+0x([0-9a-f]+))?")
LOOP_WATCH = ("QGMMA", "HGMMA", "MUFU", "SHFL", "LDL", "STL", "SYNCS", "BAR", "MEMBAR")


def instructions(sass: str) -> list[tuple[int, str, int | None]]:
  """``(address, opcode, target)`` of each SASS instruction; ``target``: a predicated
  branch's (a loop's back edge, or a barrier wait's retry), else None."""
  out = []
  for line in sass.splitlines():
    m = _INSTRUCTION.match(line)
    if m:
      predicated, op, target = m.group(2), m.group(3), m.group(4)
      out.append((int(m.group(1), 16), op,
                   int(target, 16) if op == "BRA" and predicated and target else None))
  return out


def opcode_histogram(sass: str) -> collections.Counter:
  return collections.Counter(op for _, op, _ in instructions(sass))


def loops(sass: str, min_size: int = 100) -> list[tuple[int, int, collections.Counter]]:
  """The bodies of predicated backward branches of at least ``min_size`` instructions
  (the kernels' page loops; the out-of-line barrier-wait retries jump back unpredicated):
  ``(first address, branch address, opcode counts)``, in address order."""
  code = instructions(sass)
  bodies = []
  for address, op, target in code:
    if target is not None and target < address:
      counts = collections.Counter(o for a, o, _ in code if target <= a <= address)
      if sum(counts.values()) >= min_size:
        bodies.append((target, address, counts))
  return sorted(bodies)


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--batch", type=int, default=8)
  parser.add_argument("--heads", type=int, default=128)
  parser.add_argument("--context", type=int, default=2048)
  parser.add_argument("--out", required=True)
  parser.add_argument("--only", default="", help="comma-separated kernels (default: all)")
  parser.add_argument("--offline", action="store_true",
                      help="compile for a compile-only Hopper device (no GPU; see above)")
  args = parser.parse_args()

  from bench.kernel import impls, make_inputs
  only = set(filter(None, args.only.split(",")))
  kernels = {k: v for k, v in impls().items()
             if k != "xla-bf16" and (not only or k in only)}
  inputs = make_inputs(args.batch, args.heads, 1, args.context, {"bf16", "fp8"})
  if args.offline:
    from snapmla_jax import platform
    platform.on_hopper = lambda: True  # the kernels' platform check: the target is one
    target = compile_only_sharding()
    inputs = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=target),
                          inputs)
  q, r, caches, bt, sl = inputs
  rows = []
  for name, (kind, f) in kernels.items():
    dump = os.path.join(args.out, name)
    os.makedirs(dump, exist_ok=True)
    switches = dict(MOSAIC_GPU_DUMP_TO=dump, MOSAIC_GPU_DUMP_PTX="1", MOSAIC_GPU_DUMP_PTXAS="1")
    os.environ.update(switches)
    failed = None
    with capture_fds(os.path.join(dump, "compile.log")):  # the C++ side prints to fd 1 and 2
      try:
        if args.offline:
          jax.jit(f).trace(q, r, caches[kind], bt, sl).lower(
              lowering_platforms=("cuda",)).compile()
        else:
          jax.block_until_ready(jax.jit(f)(q, r, caches[kind], bt, sl))
      except Exception as e:  # noqa: BLE001 - a ptxas failure: keep its dumps and log
        failed = f"{type(e).__name__}: {str(e)[:2000]}"
    for key in switches:
      del os.environ[key]
    if failed:
      print(f"\n== {name}: compile failed: {failed}")
    texts = {}
    for path in sorted(glob.glob(os.path.join(dump, "*"))):
      with open(path, encoding="latin-1") as fh:
        texts[os.path.basename(path)] = fh.read()
    print(f"\n== {name}: dumped {sorted(texts)}")
    report = "\n".join(texts.values())
    for line in report.splitlines():
      if len(line) > 300:   # the binary's bytes, printed inside the MLIR module
        continue
      if re.match(r"\s*(ptxas|\d+ bytes stack frame)", line):
        print("  ptxas:", line.strip())
    # the decode kernel's cubin: the largest (the FP8 route also compiles the Q-quant kernel)
    cubin = max(filter(None, map(extract_cubin, texts.values())), key=len, default=None)
    sass = ""
    if cubin:
      with open(os.path.join(dump, "kernel.cubin"), "wb") as fh:
        fh.write(cubin)
      sass = disassemble(os.path.join(dump, "kernel.cubin"))
      with open(os.path.join(dump, "kernel.sass"), "w") as fh:
        fh.write(sass)
    for path in glob.glob(os.path.join(dump, "*")):   # keep what is worth bringing back
      if not path.endswith((".ptx", ".ptxas", ".sass", ".resources.txt")) and not (
          failed and path.endswith((".log", ".mlir"))):
        os.remove(path)
    counts = opcode_histogram(sass)
    rows.append((name, counts))
    print("  total SASS instructions:", sum(counts.values()))
    for first, last, body in loops(sass):  # instructions per iteration, per warp
      watched = ", ".join(f"{op} {body[op]}" for op in LOOP_WATCH)
      print(f"  loop {first:#x}-{last:#x}: {sum(body.values())} instructions ({watched})")
  print("\n| opcode | " + " | ".join(n for n, _ in rows) + " |")
  print("|---|" + "---|" * len(rows))
  for op in WATCH:
    print(f"| {op} | " + " | ".join(str(c[op]) for _, c in rows) + " |")


if __name__ == "__main__":
  main()
