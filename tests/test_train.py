"""The byte-level trainer of the fidelity study's model (``models.train``)."""

import jax.numpy as jnp
import numpy as np

from models import load_pretrained, save_pretrained
from models import train


def test_stdlib_corpus_holds_out_about_one_file_in_twenty():
  train_bytes, held_out = train.stdlib_corpus()
  assert train_bytes.dtype == held_out.dtype == np.uint8
  assert len(train_bytes) > 5e6
  assert 0.02 < len(held_out) / (len(train_bytes) + len(held_out)) < 0.10
  assert b"def " in held_out[:200_000].tobytes()


def test_training_lowers_the_loss_and_the_checkpoint_loads_back(tmp_path):
  cfg = train.byte_model_config(layers=3, heads=2, hidden=64, window=64)
  data = np.frombuffer(b"".join(f"def f{i}(x):\n  return x * {i}\n".encode()
                                for i in range(2000)), np.uint8)
  model, losses = train.train(cfg, data, steps=40, batch=4, window=64, lr=3e-3,
                              log=lambda _: None)
  assert np.isfinite(losses).all()
  assert np.mean(losses[-5:]) < np.mean(losses[:5]) - 1.0, losses
  save_pretrained(model, tmp_path / "ckpt")
  ids = jnp.asarray(train.windows(data, np.random.default_rng(0), 2, 64)[:, :-1])
  np.testing.assert_array_equal(np.asarray(load_pretrained(tmp_path / "ckpt")(ids)),
                                np.asarray(model(ids)))
