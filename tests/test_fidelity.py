"""``bench/fidelity.py`` end to end on a tiny trained model (the study itself runs on the H200)."""

import json

import numpy as np

from bench import fidelity


def test_tiny_study_runs_end_to_end(tmp_path):
  fidelity.main(["--tiny", "--train-steps", "5", "--decode", "16", "--sequences", "1",
                 "--out", str(tmp_path)])
  results = json.loads((tmp_path / "metrics.json").read_text())
  names = [cfg.name for cfg in fidelity.CONFIGS]
  assert list(results["configs"]) == names
  assert all(len(results["per_layer"][n]) == results["layers"] == 2 for n in names)
  for row in results["per_layer"]["BF16"]:
    assert row["rmse"] == row["rel_l2"] == 0.0 and abs(row["cos_diff"]) < 1e-12
  assert results["end_to_end"]["BF16"]["kl"] == 0.0
  assert results["end_to_end"]["BF16"]["argmax_agreement"] == 1.0
  for name in names[1:]:  # FP8 errors: present, and of E4M3's size
    rel = [row["rel_l2"] for row in results["per_layer"][name]]
    assert all(1e-4 < r < 0.2 for r in rel), (name, rel)
  stats = results["cache_statistics"]
  assert len(stats) == 2 and len(stats[0]["amax_rope"]) == results["window"] - results["decode"]
  assert np.isfinite([s["mse_rope_A"] for s in stats]).all()
  assert (tmp_path / "fidelity_layers.png").stat().st_size > 10_000
  assert (tmp_path / "results.md").read_text().count("\n| ") >= len(names) + 2


def test_output_errors_definitions():
  ref = np.array([3.0, 4.0])
  errors = fidelity.output_errors(ref * 1.1, ref)
  np.testing.assert_allclose([errors["rmse"], errors["cos_diff"], errors["rel_l2"]],
                             [np.sqrt((0.3 ** 2 + 0.4 ** 2) / 2), 0.0, 0.1], atol=1e-12)
