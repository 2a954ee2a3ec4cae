"""How the FP8 kernel's error grows with the pages one CTA visits.

One sequence of ``pages`` pages, against the exact emulation and the f32 reference:

* ``in place, capped``: the kernel's default (P V accumulated in place on the FP8 wgmma,
  whose additions keep ~14 bits; splits of at most ``FP8_PV_MAX_PAGES`` pages);
* ``in place, 1 split``: the same over every page in one CTA (``no_split_cap`` ablation);
* ``promoted, 1 split``: ``TuningConfig.promote_pv`` (each page's product added in f32).

A GPU script: prints a markdown table.

  python bench/pv_precision.py [--pages 16 64 256 1024 2048] [--heads 64]
"""

from __future__ import annotations

import argparse

import numpy as np

from bench.ablate import variant
from bench.kernel import SCALE
from snapmla_jax import quant
from snapmla_jax.pallas.common import TuningConfig
from snapmla_jax.reference import mla_decode_reference, snapmla_emulate
from snapmla_jax.testing import make_case, rel_l2


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--pages", type=int, nargs="*", default=[16, 64, 256, 1024, 2048])
  parser.add_argument("--heads", type=int, default=64)
  args = parser.parse_args()
  base, uncapped = variant("base").mla_decode_fp8, variant("no_split_cap").mla_decode_fp8
  kernels = {"in place, capped": (base, TuningConfig()),
             "in place, 1 split": (uncapped, TuningConfig(num_splits=1)),
             "promoted, 1 split": (base, TuningConfig(num_splits=1, promote_pv=True))}
  lines = ["| pages a CTA | kernel | rel L2 vs emulation | rel L2 vs f32 | emulation vs f32 |",
           "|---|---|---|---|---|"]
  for pages in args.pages:
    case = make_case(pages, [pages * 64], heads=args.heads, kinds=("fp8",))
    cache = case.caches["fp8"]
    emu, _ = snapmla_emulate(case.q_nope, case.q_rope, cache, case.block_table,
                             case.seq_lens, softmax_scale=SCALE)
    ref, _ = mla_decode_reference(case.q_nope, case.q_rope, case.ckv, case.k_rope,
                                  case.seq_lens, softmax_scale=SCALE)
    qc, qs, qr = quant.quantize_query(case.q_nope, case.q_rope)
    for name, (kernel, config) in kernels.items():
      out, _ = kernel(qc, qs, qr, cache.content, cache.scale, cache.rope, case.block_table,
                      case.seq_lens, softmax_scale=SCALE, config=config)
      out = np.asarray(out, np.float32)
      lines.append(f"| {pages} | {name} | {rel_l2(out, emu):.2e} | {rel_l2(out, ref):.2e} | "
                   f"{rel_l2(np.asarray(emu), ref):.2e} |")
      print(lines[-1], flush=True)
  print("\n".join(lines))


if __name__ == "__main__":
  main()
