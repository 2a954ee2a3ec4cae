"""Differential timing of the decode kernels: where does a page-step's time go?

Builds variants of ``snapmla_jax.pallas.mla_decode_fp8`` (``--kernel bf16``:
``mla_decode_bf16``, ``BF16_ABLATIONS``) that each leave one stage out
(by substituting its source lines; results are wrong, times are what matter) and times
them against the unchanged kernel in one process, at the benchmark's shapes. The time a
stage costs on the critical path is ``base - variant`` (METHOD.md: time variants that
leave one stage out and take differences). A substitution that no longer matches the
source fails loudly.

  python bench/ablate.py [--shapes 32,128,1,16384 128,16,1,16384] [--only NAME,...]
                        [--kernel bf16|swap_ab|seesaw] [--multicast] [--l2-pages]
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect

from snapmla_jax import quant
from snapmla_jax.pallas import (common, mla_decode_bf16, mla_decode_fp8, mla_decode_fp8_seesaw,
                                mla_decode_fp8_swap_ab)

ABLATIONS = {  # name: [(old source, new source), ...]
    "base": [],
    "no_vt_bitops": [
        ("even = permute_bytes(lo_rows, hi_rows, 0x6240)", "even = lo_rows"),
        ("odd = permute_bytes(lo_rows, hi_rows, 0x7351)", "odd = hi_rows"),
    ],
    "no_vt_build": [
        ('    prepare = dequantize_v if pv_impl == "f16" else transpose_v\n',
         '    prepare = dequantize_v if pv_impl == "f16" else (lambda *a: None)\n'),
    ],
    "no_exp": [
        # The softmax step lives in common: trace it with exp2 as the identity.
        ("common.online_softmax_step(s * k_scale",
         "_without_exp2(common.online_softmax_step)(s * k_scale"),
        ('PvImpl = Literal["f16", "fp8"]\n',
         'PvImpl = Literal["f16", "fp8"]\n\n\n'
         'def _without_exp2(f):\n'
         '  def traced(*args):\n'
         '    exp2, jnp.exp2 = jnp.exp2, lambda x: x\n'
         '    try:\n'
         '      return f(*args)\n'
         '    finally:\n'
         '      jnp.exp2 = exp2\n'
         '  return traced\n'),
    ],
    "no_p_quant": [
        ("p_q = (p_fused * common.row_broadcast(inv_sigma, p_fused.shape)).astype(_FP8)",
         "p_q = p_fused.astype(_FP8)"),
    ],
    "no_store_p": [
        ("p_smem[...] = permute_bytes(p_q[:, :_HALF_PAGE], p_q[:, _HALF_PAGE:], 0x5140)",
         "pass"),
    ],
    # V^T's bytes interleaved by jnp's shifts and masks (the form before prmt)
    "v_pack_shifts": [
        ("permute_bytes(lo_rows, hi_rows, 0x6240)", "(lo_rows & _U16(0xFF)) | (hi_rows << 8)"),
        ("permute_bytes(lo_rows, hi_rows, 0x7351)", "(lo_rows >> 8) | (hi_rows & _U16(0xFF00))"),
    ],
    # Warpgroup 1 refills page i's slot one page later (while preparing page i + 1), so that
    # it does not stall on the other consumers' (and, multicast, the other CTA's) release.
    "refill_late": [
        ("      release_slot(kv_free, step, slot, num_stages, num_steps, refill)\n",
         "      release_slot(kv_free, step, slot, num_stages, num_steps)\n"
         "      if refill:\n"
         "        @pl.when((step >= 1) & (step - 1 + num_stages < num_steps))\n"
         "        def _():\n"
         "          previous = lax.rem(step - 1, num_stages)\n"
         "          plgpu.barrier_wait(kv_free.at[previous])\n"
         "          refill(step - 1 + num_stages, previous)\n"),
    ],
    # The softmax warpgroup up to three pages ahead of P V instead of two (4 KB more SMEM)
    "p_buffers_3": [("P_BUFFERS = 2 ", "P_BUFFERS = 3 ")],
    # The next page's QK issued after this page's softmax and quantization (before P's
    # store): a late page no longer holds back this page's softmax, but QK runs under less.
    "qk_after_quantize": [
        ("        @pl.when(step + 1 < num_steps)\n"
         "        def _():\n"
         "          issue_qk(step + 1, s_next_ref, q_content)\n"
         "        m_new, alpha, l_new, p_fused = softmax_page(",
         "        m_new, alpha, l_new, p_fused = softmax_page("),
        ("        with jax.named_scope(\"store_p\"):\n          hand_off_p(step, p_q, factor)\n",
         "        @pl.when(step + 1 < num_steps)\n"
         "        def _():\n"
         "          issue_qk(step + 1, s_next_ref, q_content)\n"
         "        with jax.named_scope(\"store_p\"):\n          hand_off_p(step, p_q, factor)\n"),
    ],
    "no_pv": [
        ("        acc = accumulate(acc * common.row_broadcast(factor, acc.shape), buf, v)\n",
         "        acc = acc * common.row_broadcast(factor, acc.shape)\n"),
    ],
    # With --promote-pv: the chunks of the page's product in f32 (accumulate_pv_fp8)
    "pv_chunk_64": [("PV_CHUNK = 32 ", "PV_CHUNK = 64 ")],
    "pv_serial": [("wait_n=1", "wait_n=0")],  # each chunk waits for the next one too
    # P V accumulated in place over every page of a split, however many
    "no_split_cap": [("FP8_PV_MAX_PAGES = 256 ", "FP8_PV_MAX_PAGES = 1 << 30 ")],
    "same_page": [  # every step reads the split's first page: L2-resident, no HBM latency
        ("bt_ref[b, first_page + step], slot, kv_ready, pair_axis,",
         "bt_ref[b, first_page], slot, kv_ready, pair_axis,"),
    ],
    "one_stage_less": [("return 4 if v_in_q and not overlap_pv else 3",
                        "return 3 if v_in_q and not overlap_pv else 2")],
    # V^T ahead with one V^T buffer (page i + 1's V^T overwrites page i's before its P V:
    # wrong results, the same work) and the SMEM so freed spent on a 4th stage: would a
    # deeper ring pay for the SMEM that a second V^T buffer takes?
    "vt_ahead_4_stages": [
        ("v_pages=2 if overlap_pv else None", "v_pages=1 if overlap_pv else None"),
        ("parity = lax.rem(step, 2)", "parity = step * 0"),
        ("prepare_page(step + 1, 1 - parity)", "prepare_page(step + 1, parity)"),
        ("return 4 if v_in_q and not overlap_pv else 3", "return 4 if v_in_q else 3"),
    ],
    # Q's RoPE tile as the RoPE wgmma's A operand in registers, as Q's content is: 8 KB of
    # SMEM (half of what a 4th stage under V^T ahead lacks) for 16 registers.
    "q_rope_in_registers": [
        ("                 else qc_smem)\n",
         "                 else qc_smem)\n"
         "    q_rope = plgpu.load(qr_smem, layout=plgpu.Layout.WGMMA)\n"),
        ("plgpu.wgmma(s_ref, qr_smem, kr_smem.at[slot].T)",
         "plgpu.wgmma(s_ref, q_rope, kr_smem.at[slot].T)"),
    ],
    "auto_barriers": [("common.compiler_params(auto_barriers=False)", "common.compiler_params()")],
    "no_rope_qk": [("plgpu.wgmma(s_ref, qr_smem, kr_smem.at[slot].T)\n", "\n")],
}

# Both P V warpgroups idle but for their barriers: what is left is the softmax warpgroup's chain.
ABLATIONS["pv_wgs_idle"] = ABLATIONS["no_vt_build"] + ABLATIONS["no_pv"]
# The softmax warpgroup's chain taken apart (P V warpgroups idle in each): its page loads
# from L2 only, without the RoPE QK, without P's store, and with no softmax at all
# (P_q = S: QK, the barriers, P's store and the SMEM fence remain).
ABLATIONS["idle_same_page"] = ABLATIONS["pv_wgs_idle"] + ABLATIONS["same_page"]
ABLATIONS["idle_no_rope_qk"] = ABLATIONS["pv_wgs_idle"] + ABLATIONS["no_rope_qk"]
ABLATIONS["idle_no_store_p"] = ABLATIONS["pv_wgs_idle"] + ABLATIONS["no_store_p"]
ABLATIONS["idle_no_softmax"] = ABLATIONS["pv_wgs_idle"] + [
    ("m_new, alpha, p, l_new = common.online_softmax_step(s * k_scale, m_i, l_i, q_scale,\n"
     "                                                            visible)",
     "m_new, alpha, p, l_new = m_i, l_i * 0.0 + 1.0, s, l_i"),
    ("        p_fused = p * k_scale\n", "        p_fused = p\n"),
    ("sigma, inv_sigma, p_q = quantize_p_tile(p_fused, sigma_i)",
     "sigma, inv_sigma, p_q = sigma_i, sigma_i, p_fused.astype(_FP8)"),
]
# Is QK's latency on the softmax warpgroup's chain (it is issued a page ahead, under the
# softmax)? Each page's content QK issued twice: the chain grows by QK's time if so.
ABLATIONS["qk_twice"] = [("    plgpu.wgmma(s_ref, q_content, kc_smem.at[slot].T)\n",
                          "    plgpu.wgmma(s_ref, q_content, kc_smem.at[slot].T)\n" * 2)]
ABLATIONS["idle_qk_twice"] = ABLATIONS["pv_wgs_idle"] + ABLATIONS["qk_twice"]
# ... or the next page's QK waited for at once, before this page's softmax (no overlap):
# if the chain does not grow, QK and the softmax did not overlap to begin with.
ABLATIONS["idle_qk_serial"] = ABLATIONS["pv_wgs_idle"] + [
    ('          issue_qk(step + 1, s_next_ref, q_content)\n        m_new, alpha, l_new, p_fused = ',
     '          issue_qk(step + 1, s_next_ref, q_content)\n        plgpu.wgmma_wait(0)\n'
     '        m_new, alpha, l_new, p_fused = ')]
# Does QK block the softmax warpgroup because its A operand (Q) is in that warpgroup's
# registers? With the P V warpgroups idle, Q's SMEM is never overwritten by V^T, so QK can
# read its A from SMEM instead (as before bf21e1a); then serialize it as idle_qk_serial.
ABLATIONS["idle_q_smem"] = ABLATIONS["pv_wgs_idle"] + [
    ("plgpu.wgmma(s_ref, q_content, kc_smem.at[slot].T)",
     "plgpu.wgmma(s_ref, qc_smem, kc_smem.at[slot].T)")]
ABLATIONS["idle_q_smem_qk_serial"] = (ABLATIONS["idle_q_smem"]
                                      + ABLATIONS["idle_qk_serial"][len(ABLATIONS["pv_wgs_idle"]):])
# P's hand-off without its proxy fence and warpgroup barrier (MEMBAR.ALL.CTA, FENCE.VIEW.
# ASYNC.S, BAR.SYNC in SASS): what the fence costs the chain (results may be wrong).
ABLATIONS["no_p_fence"] = [
    ("    factor_smem.at[buf][...] = factor\n    plgpu.commit_smem()\n",
     "    factor_smem.at[buf][...] = factor\n")]
ABLATIONS["idle_no_p_fence"] = ABLATIONS["pv_wgs_idle"] + ABLATIONS["no_p_fence"]
# ... and without QK (S stays zero): the skeleton of TMA waits, barriers and P's store.
ABLATIONS["idle_skeleton"] = ABLATIONS["idle_no_softmax"] + ABLATIONS["no_rope_qk"] + [
    ("plgpu.wgmma(s_ref, q_content, kc_smem.at[slot].T)\n", "\n")]
# Is the skeleton's floor HBM's (pages from L2 only would lift it) or L2 -> SM's (the same)?
ABLATIONS["idle_skeleton_same_page"] = ABLATIONS["idle_skeleton"] + ABLATIONS["same_page"]
# Does the skeleton's page rate follow the ring's depth (latency-bound) or not (bandwidth)?
ABLATIONS["idle_skeleton_one_stage_less"] = (ABLATIONS["idle_skeleton"]
                                             + ABLATIONS["one_stage_less"])

# schedule="two_softmax_wgs" (two softmax warpgroups on alternate pages) in softmax_wg's
# place, at its register split (88 softmax / 168 P V a thread) and at 96 / 160 (ptxas,
# offline: spill instructions 162 / 48 at 88 / 168, 114 / 92 at 96 / 160; the P V
# warpgroups spill half their accumulator at 152).
ABLATIONS["two_softmax_wgs"] = [(
    'softmax_wgs=2 if schedule == "two_softmax_wgs" else 1,', "softmax_wgs=2,")]
ABLATIONS["two_softmax_wgs_96"] = ABLATIONS["two_softmax_wgs"] + [
    ("SOFTMAX_REGISTERS = 88\n", "SOFTMAX_REGISTERS = 96\n"),
    ("PV_REGISTERS = 168\n", "PV_REGISTERS = 160\n")]

# The softmax warpgroup's unmasked pages one an iteration (S's registers rotated by moves)
# instead of two.
ABLATIONS["one_page_loop"] = [(
    "    carry = lax.fori_loop(0, num_full // 2, two_pages, carry)\n"
    "    carry = lax.fori_loop(num_full // 2 * 2, num_full,",
    "    carry = lax.fori_loop(0, num_full,")]


# The BF16 kernel (issue 3's baseline): is its page-step set by the page feed (72 KB a page
# on a 2-stage ring) or by warpgroup 0's chain (QK, softmax, P's store, its half of P V)?
BF16_ABLATIONS = {
    "base": [],
    "no_pv": [("    return common.accumulate_pv(\n", "    return acc\n    return common.accumulate_pv(\n")],
    "no_qk": [("        plgpu.wgmma(s_ref, q_smem, kv_smem.at[slot].T)\n", "        pass\n")],
    "no_softmax": [  # P = S, alpha = l (the FMULs of the rescale stay)
        ("m_new, alpha, p, l_i = common.online_softmax_step(s, m_i, l_i, scale_log2, visible)",
         "m_new, alpha, p = m_i, l_i, s")],
    "same_page": [("page = bt_ref[b, first_page + step]", "page = bt_ref[b, first_page]")],
}
# The feed alone: TMAs, barriers and P's store (S stays zero).
BF16_ABLATIONS["skeleton"] = (BF16_ABLATIONS["no_pv"] + BF16_ABLATIONS["no_qk"]
                              + BF16_ABLATIONS["no_softmax"])
BF16_ABLATIONS["skeleton_same_page"] = BF16_ABLATIONS["skeleton"] + BF16_ABLATIONS["same_page"]
BF16_ABLATIONS["no_qk_no_softmax"] = BF16_ABLATIONS["no_qk"] + BF16_ABLATIONS["no_softmax"]

# The FP8 kernel's swap_ab schedule (the default at 16 query rows), V^T from registers: which
# warpgroup's chain sets its page-step (``--kernel swap_ab --l2-pages``)? One page a step
# (the thirteenth session's) against PAGES_PER_STEP.
SWAP_AB_ABLATIONS = {
    "base": [],
    "no_pv": [("          plgpu.wgmma(acc_ref, vt_tile, p_smem.at[buf].T)\n",
               "          del acc_ref, vt_tile\n")],
    "no_vt_build": [(
        "        vt = transpose_v_registers(kc16_smem.at[slot], half, (first_page + step) * PAGE_SIZE,\n"
        "                                   seq_len, masked)\n",
        "        vt = [plgpu.layout_cast(jnp.zeros((QUERY_TILE, PAGE_SIZE), _FP8),\n"
        "                                plgpu.Layout.WGMMA_8BIT)] * 4\n")],
    # the softmax's two reductions across warps a step (max, P's block maxima) left out
    "no_reductions": [
        ("          m_new = jnp.maximum(m_i, functools.reduce(jnp.maximum, ts).max(axis=0))\n",
         "          m_new = jnp.maximum(m_i, full(0.0))\n"),
        ("          p_max = p_maxima[j * n:(j + 1) * n] if pages > 1 else p_maxima\n",
         "          p_max = full(1.0)\n")],
    "no_p_store": [("        store_p_columns(p_q, p16_smem.at[buf])\n", "        del p_q\n")],
    # A candidate, not an ablation (results stay right up to rounding): one exchange across
    # the warps a step instead of two, each page's P' block max taken from its exponent:
    # max_t P'[t] = 2^(max_t (q t + log2 scale_k[t]) - q m), masked tokens -inf.
    "one_exchange": [
        ("          m_new = jnp.maximum(m_i, functools.reduce(jnp.maximum, ts).max(axis=0))\n",
         "          us = [t * columns(q_scale) + jnp.log2(k) for t, k in zip(ts, k_scales)]\n"
         "          if masked:\n"
         "            us = [jnp.where(v, u, -jnp.inf) for v, u in zip(visibles, us)]\n"
         "          both = jnp.concatenate([functools.reduce(jnp.maximum, ts), *us],\n"
         "                                 axis=1).max(axis=0)\n"
         "          m_new = jnp.maximum(m_i, both[:n])\n"),
        ("          p_maxima = (jnp.concatenate(p_fused, axis=1) if pages > 1 else p_fused[0]).max(axis=0)\n",
         ""),
        ("          p_max = p_maxima[j * n:(j + 1) * n] if pages > 1 else p_maxima\n",
         "          p_max = jnp.exp2(both[(j + 1) * n:(j + 2) * n] - m_use * q_scale)\n"),
        ("  return 128 * n * PAGES_PER_STEP\n", "  return 128 * n * (PAGES_PER_STEP + 1)\n")],
    # the thirteenth session's softmax: one page a step, two exchanges across warps each
    "one_page_steps": [("PAGES_PER_STEP = 2 ", "PAGES_PER_STEP = 1 ")],
    "stages_3": [("EXTRA_STAGES = 2\n", "EXTRA_STAGES = 1\n")],
}
SWAP_AB_ABLATIONS["pv_wgs_idle"] = SWAP_AB_ABLATIONS["no_pv"] + SWAP_AB_ABLATIONS["no_vt_build"]
SWAP_AB_ABLATIONS["idle_no_reductions"] = (SWAP_AB_ABLATIONS["pv_wgs_idle"]
                                           + SWAP_AB_ABLATIONS["no_reductions"])
# The seesaw (two warpgroups taking turns with the pages, 4-stage ring, V^T in place): where
# does its page-step go (``--kernel seesaw``)?
SEESAW_ABLATIONS = {
    "base": [],
    "no_pv": [(
        "      return common.accumulate_pv(acc * common.row_broadcast(gamma, acc.shape),\n"
        "                                  p_smem.at[buf], v_operand(step, half), in_place=in_place)\n",
        "      return acc * common.row_broadcast(gamma, acc.shape)\n")],
    "no_vt_build": [(
        '      if pv_impl == "fp8" and not SPLIT_VT:\n        with jax.named_scope("prepare_v"):\n'
        '          prepare_v(step, masked)\n', "")],
    "no_softmax": [(  # P' = S, the rows' state constant (the combine stays)
        "        m_loc, l_loc, p_fused, p_max = page_local_softmax(scores, k_scale, q_scale, visible)\n",
        "        m_loc = l_loc = p_max = common.zero_rows(QUERY_TILE, 1.0)\n"
        "        p_fused = scores\n")],
    "stages_2": [("STAGES = 4 ", "STAGES = 2 ")],
    # The two warpgroups' coupling (timing only: the values read are stale): the combine
    # without the other warpgroup's state of the step before, and the other's page's P V
    # without its P_q.
    "no_state_wait": [
        ("        @pl.when(step > 0)\n        def _():\n"
         "          plgpu.barrier_wait(state_ready.at[prev])\n", ""),
        ("    @pl.when(others_last)\n    def _():\n"
         "      plgpu.barrier_wait(state_ready.at[last_buf])\n", "")],
    "no_p_wait": [("      if not p_waited:\n        plgpu.barrier_wait(p_ready.at[buf])\n", "")],
    "anti_phase": [("ANTI_PHASE = False", "ANTI_PHASE = True")],  # the module's switches
    "split_vt": [("SPLIT_VT = False", "SPLIT_VT = True")],
    # QK's A operand from registers, as the default kernel (-6.5% there); offline ptxas:
    # 172 B of spills (43 STL + 43 LDL) against none
    "q_in_registers": [
        ("          plgpu.wgmma(s_ref, qc_smem.at[:, pl.ds(h * HALF_DIM, HALF_DIM)],\n",
         "          plgpu.wgmma(s_ref, q_halves[h],\n"),
        ("    q_scale = plgpu.load(qs_smem, layout=row_layout) * scale_log2\n",
         "    q_scale = plgpu.load(qs_smem, layout=row_layout) * scale_log2\n"
         "    q_halves = [plgpu.load(qc_smem.at[:, pl.ds(h * HALF_DIM, HALF_DIM)],\n"
         "                           layout=plgpu.Layout.WGMMA_8BIT) for h in _CONTENT_HALVES]\n")],
}
SEESAW_ABLATIONS["pv_idle"] = SEESAW_ABLATIONS["no_pv"] + SEESAW_ABLATIONS["no_vt_build"]
SEESAW_ABLATIONS["decoupled"] = SEESAW_ABLATIONS["no_state_wait"] + SEESAW_ABLATIONS["no_p_wait"]
SEESAW_ABLATIONS["split_vt_anti_phase"] = (SEESAW_ABLATIONS["split_vt"]
                                           + SEESAW_ABLATIONS["anti_phase"])
KERNELS = {"fp8": (mla_decode_fp8, ABLATIONS), "bf16": (mla_decode_bf16, BF16_ABLATIONS),
           "swap_ab": (mla_decode_fp8_swap_ab, SWAP_AB_ABLATIONS),
           "seesaw": (mla_decode_fp8_seesaw, SEESAW_ABLATIONS)}


def patched(module, edits, name: str, **names):
  """A fresh copy of ``module`` with the source edits applied (and ``names`` defined)."""
  source = inspect.getsource(module)
  for old, new in edits:
    if source.count(old) != 1:
      raise ValueError(f"ablation {name}: {old!r} occurs {source.count(old)} times")
    source = source.replace(old, new)
  spec = importlib.util.spec_from_loader(f"ablated_{name}", loader=None)
  module = importlib.util.module_from_spec(spec)
  module.__dict__.update(names)
  exec(compile(source, f"<{name}>", "exec"), module.__dict__)
  return module


def variant(name: str, kernel: str = "fp8"):
  """The kernel module with ablation ``name`` applied, as a fresh module (``swap_ab`` and
  ``seesaw``: a ``mla_decode_fp8`` whose schedule of that name is the ablated one)."""
  module, ablations = KERNELS[kernel]
  ablated = patched(module, ablations[name], name)
  if kernel not in ("swap_ab", "seesaw"):
    return ablated
  module_name = f"mla_decode_fp8_{kernel}"
  return patched(mla_decode_fp8, [(f"    from snapmla_jax.pallas import {module_name}\n",
                                   f"    {module_name} = _ABLATED\n")],
                 name, _ABLATED=ablated)


def variant_decode(name: str, config, pv: str = "fp8", kernel: str = "fp8"):
  """``f(q_nope, q_rope, cache, block_table, seq_lens)``: the decode of variant ``name``
  at the benchmark's softmax scale (FP8: the query quantized outside the timed call)."""
  from bench.kernel import SCALE
  module = variant(name, kernel)
  if kernel == "bf16":
    return lambda q, r, c, bt, sl: module.mla_decode_bf16(
        q, r, c.latent, bt, sl, softmax_scale=SCALE, config=config)

  schedule = kernel if kernel in ("swap_ab", "seesaw") else "softmax_wg"

  def f(qc, qs, qr, c, bt, sl):
    return module.mla_decode_fp8(qc, qs, qr, c.content, c.scale, c.rope, bt, sl,
                                 softmax_scale=SCALE, pv=pv, config=config, schedule=schedule)
  return f


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--shapes", nargs="*", default=["32,128,1,16384", "128,16,1,16384"],
                      help="batch,heads,s_q,context")
  parser.add_argument("--only", default="", help="comma-separated ablations (base always)")
  parser.add_argument("--pv", default="fp8")
  parser.add_argument("--splits", type=int, default=None,
                      help="KV splits per sequence (fewer CTAs than SMs: per-SM vs global limits)")
  parser.add_argument("--in-order-pv", action="store_true",
                      help="TuningConfig(overlap_pv=False): V^T built after the previous P V")
  parser.add_argument("--promote-pv", action="store_true", help="TuningConfig.promote_pv")
  parser.add_argument("--multicast", action="store_true", help="TuningConfig.multicast")
  parser.add_argument("--kernel", choices=KERNELS, default="fp8",
                      help="fp8: the softmax_wg schedule; swap_ab, seesaw: the FP8 kernel's others")
  parser.add_argument("--l2-pages", action="store_true",
                      help="every sequence reads the same pages, from L2 (no HBM bound)")
  args = parser.parse_args()
  from bench.kernel import make_inputs, measure

  chosen = args.only.split(",") if args.only else KERNELS[args.kernel][1]
  names = ["base"] + [n for n in chosen if n and n != "base"]
  lines = ["| shape | variant | time (us) | us per page-step | saved vs base (us) |",
           "|---|---|---|---|---|"]
  for shape in args.shapes:
    batch, heads, s_q, context = map(int, shape.split(","))
    kind = "bf16" if args.kernel == "bf16" else "fp8"
    q, r, caches, bt, sl = make_inputs(batch, heads, s_q, context, {kind}, args.l2_pages)
    c = caches[kind]
    inputs = (q, r) if kind == "bf16" else quant.quantize_query(q, r)
    tile = (mla_decode_fp8_swap_ab.tile_rows(s_q, heads) if args.kernel == "swap_ab"
            else common.QUERY_TILE)
    row_tiles = common.num_row_tiles(s_q, heads, tile)
    if args.kernel == "bf16":
      config = common.TuningConfig(num_splits=args.splits, multicast=args.multicast)
      splits = args.splits or common.default_num_splits(batch, row_tiles, context // 64)
    else:
      config = common.TuningConfig(
          num_splits=args.splits, overlap_pv=False if args.in_order_pv else None,
          promote_pv=args.promote_pv, multicast=args.multicast)
      # the unchanged kernel's splits (no_split_cap's differ: its per-step figure is off)
      splits = mla_decode_fp8.split_count(batch, row_tiles, context // 64, config, args.pv)
    waves = -(-batch * row_tiles * splits // common.HOPPER_NUM_SMS)
    steps = waves * (context // 64) / splits   # page-steps on the longest-running SM
    base = None
    for name in names:
      f = variant_decode(name, config, args.pv, args.kernel)
      try:
        t = measure(f, *inputs, c, bt, sl) * 1e6
      except Exception as e:  # noqa: BLE001 - report and go on
        print(f"{name}: {type(e).__name__}: {str(e)[:300]}")
        continue
      base = t if name == "base" else base
      saved = "" if base is None or name == "base" else f"{base - t:.1f}"
      label = f"b{batch} h{heads} s_q{s_q} {context // 1024}k, {splits} splits"
      lines.append(f"| {label} | {name} | {t:.1f} | "
                   f"{t / steps:.3f} | {saved} |")
      print(lines[-1], flush=True)
  print("\n".join(lines))


if __name__ == "__main__":
  main()
