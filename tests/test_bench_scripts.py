"""Benchmark scripts run end to end on CPU at small shapes (their figures come from the H200)."""

import json
import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp

from bench import data_path


def test_entry_kernels_counts_the_launching_ops():
  f = jax.jit(lambda x: (jnp.sin(x) * 2, jnp.sum(x)))
  kernels = data_path.entry_kernels(f.lower(jnp.ones((4, 4))).compile().as_text())
  assert 1 <= len(kernels) <= 3 and "parameter" not in kernels and "tuple" not in kernels


def test_data_path_small_run(tmp_path, capsys):
  data_path.main(["--small", "--md", str(tmp_path / "t.md")])
  table = (tmp_path / "t.md").read_text()
  for op in ("Q-quant", "fetch-dequant", "K-append"):
    assert op in table


def test_sass_loops_are_predicated_back_edges():
  """``bench/sass.py`` counts a page loop's body; a barrier wait's out-of-line retry (an
  unpredicated jump back) is no loop."""
  from bench import sass
  body = "".join(f"        /*{0x100 + 16 * i:04x}*/                   FMUL R1, R2, R3 ;\n"
                 for i in range(120))
  text = ("        /*0100*/                   MEMBAR.ALL.CTA ;\n" + body[body.index("\n") + 1:]
          + "        /*0880*/              @P1 BRA 0x100 ;\n"
          + "        /*0890*/                   EXIT ;\n"
          + "        /*08a0*/                   BRA 0x200 ;\n")
  [(first, last, counts)] = sass.loops(text)
  assert (first, last) == (0x100, 0x880)
  assert counts["FMUL"] == 119 and counts["MEMBAR"] == 1 and counts["BRA"] == 1
  assert sass.opcode_histogram(text)["BRA"] == 2


def test_every_kernel_ablation_still_applies():
  """bench/ablate.py edits the kernels' source by exact strings: each must match once."""
  from bench import ablate
  for kernel, (_, ablations) in ablate.KERNELS.items():
    entry = "mla_decode_bf16" if kernel == "bf16" else "mla_decode_fp8"
    for name in ablations:
      assert hasattr(ablate.variant(name, kernel), entry), name


def test_e2e_fills_cache_memory(tmp_path):
  """--cache-gib: each kind's batch is what that much cache holds (2 layers x 2 pages of
  64 tokens per sequence: 294,912 B in BF16, 164,864 in FP8)."""
  from bench import e2e
  e2e.main(["--small", "--heads", "16", "--layers", "2", "--cache-gib", str(1e6 / 2**30),
            "--contexts", "100", "--steps", "1", "--md", str(tmp_path / "e2e.md")])
  rows = [line.split(" | ") for line in (tmp_path / "e2e.md").read_text().splitlines()
          if line.startswith("| 100 ")]
  assert [(r[1], r[2]) for r in rows] == [("bf16", "3"), ("fp8", "3"), ("fp8", "6")]


def test_e2e_small_run(tmp_path):
  from bench import e2e
  e2e.main(["--small", "--heads", "16", "--layers", "2", "--batch", "2", "--contexts", "100",
            "--steps", "1", "--md", str(tmp_path / "e2e.md")])
  rows = [line.split(" | ") for line in (tmp_path / "e2e.md").read_text().splitlines()
          if line.startswith("| 100 ")]
  assert [(r[1], r[2], r[3]) for r in rows] == [("bf16", "2", "1152"), ("fp8", "2", "644"),
                                                ("fp8", "3", "644")]


def test_device_check_script_parses():
  """A syntax error in the device script would cost a device call to find."""
  script = pathlib.Path(__file__).parent.parent / "bench" / "device_check.sh"
  subprocess.run(["bash", "-n", str(script)], check=True)


def test_device_scripts_parse_their_arguments():
  """Each script device_check runs builds its argument parser (``--help``): a duplicated
  or malformed option would cost a device call to find."""
  root = pathlib.Path(__file__).parent.parent
  env = {**os.environ, "PYTHONPATH": str(root)}
  for script in ("kernel.py", "ablate.py", "profile_kernel.py", "e2e.py", "data_path.py",
                 "pv_precision.py", "sass.py", "fidelity.py"):
    run = subprocess.run([sys.executable, str(root / "bench" / script), "--help"],
                         capture_output=True, text=True, cwd=root, env=env)
    assert run.returncode == 0, f"{script}: {run.stderr[-2000:]}"


def test_profile_variants_lower_for_cuda(monkeypatch):
  """``profile_kernel.py --variants`` calls ablate's variants as bench rows: they trace and
  lower (a broken one would cost a device call to find)."""
  from bench import kernel, profile_kernel
  from snapmla_jax.pallas import common
  monkeypatch.setattr(common, "check_platform", lambda interpret: None)
  q, r, caches, bt, sl = kernel.make_inputs(1, 64, 1, 256, {"fp8"})
  f = profile_kernel.ablated("idle_qk_twice", common.TuningConfig())
  hlo = jax.jit(f).trace(q, r, caches["fp8"], bt, sl).lower(lowering_platforms=("cuda",))
  assert "mosaic_gpu" in hlo.as_text()


def test_profile_summary_counts_regions(tmp_path):
  """Per (warpgroup, region): mean time per CTA and occurrences per CTA (a trace cut by
  the kernel's ``PROFILE_SPACE`` still gives each occurrence's time)."""
  from bench import profile_kernel

  def region(tid, name, begin, end):
    return [{"tid": tid, "name": name, "ph": "B", "ts": begin},
            {"tid": tid, "name": name, "ph": "E", "ts": end}]

  events = []
  for cta in range(2):  # two warpgroups a CTA: tids 1 + 2 cta + wg
    events += region(1 + 2 * cta, "softmax", 0, 2) + region(1 + 2 * cta, "softmax", 5, 9)
    events += region(2 + 2 * cta, "pv", 1, 4)
  path = tmp_path / "trace.json"
  path.write_text(json.dumps({"traceEvents": events}))
  regions, span = profile_kernel.summarize(str(path), num_wgs=2)
  assert regions == {(0, "softmax"): (6.0, 2.0), (1, "pv"): (3.0, 1.0)}
  assert span == 9
