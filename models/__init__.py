"""DeepSeek-V3-style models on the SnapMLA paged latent cache.

``load_pretrained`` reads a Hugging Face checkpoint (``save_pretrained`` writes one); ``generate`` decodes with an
FP8 (or BF16) cache; ``snapmla-demo`` (``models.cli``) is the console demo.
"""

from models.config import DeepseekV3Config, YarnScaling
from models.deepseek_v3 import DeepseekV3, init_random, load_pretrained, save_pretrained
from models.generation import generate, generate_with_logits

__all__ = ["DeepseekV3", "DeepseekV3Config", "YarnScaling", "generate", "generate_with_logits",
           "init_random", "load_pretrained",
           "save_pretrained"]
