"""Tiny models built from configs, a word-level tokenizer and a small corpus (no downloads).

A uniquely named module (not conftest) so test files import it without clashing with other conftests."""

from __future__ import annotations

import random
from pathlib import Path

import torch

WORDS = [
    "the",
    "a",
    "model",
    "weights",
    "scale",
    "format",
    "bit",
    "eight",
    "float",
    "value",
    "range",
    "small",
    "large",
    "tensor",
    "layer",
    "token",
    "sum",
    "error",
    "loss",
    "step",
    "data",
    "run",
    "test",
    "chip",
    "core",
    "memory",
    "speed",
    "block",
    "row",
    "column",
    "grid",
    "cast",
    "round",
    "max",
    "min",
    "mean",
    "amax",
    "noise",
    "signal",
    "train",
    "serve",
    "check",
    "gate",
    "pass",
    "fail",
    "report",
    "plot",
    "curve",
    "line",
]


def make_corpus(path: Path, paragraphs: int = 60, seed: int = 0) -> Path:
    rng = random.Random(seed)
    paras = []
    for _ in range(paragraphs):
        sentences = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(6, 14))) + " ." for _ in range(4)]
        paras.append(" ".join(sentences))
    path.write_text("\n\n".join(paras) + "\n", encoding="utf-8")
    return path


def make_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(["[PAD]", "[UNK]", "[EOS]", ".", *WORDS])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins word-level tokens with spaces
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]", eos_token="[EOS]"
    )


def tiny_llama(vocab_size: int, seed: int = 0, hidden: int = 64):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg).eval()


def tiny_bert(vocab_size: int, seed: int = 0):
    from transformers import BertConfig, BertModel

    cfg = BertConfig(
        vocab_size=vocab_size, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=128, max_position_embeddings=128,
    )  # fmt: skip
    torch.manual_seed(seed)
    return BertModel(cfg).eval()


def save(model, tokenizer, directory: Path) -> Path:
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def tiny_clip(vocab_size: int, seed: int = 0, image_size: int = 32):
    """A CLIPModel with 2-layer text and vision towers (random weights)."""
    from transformers import CLIPConfig, CLIPModel

    cfg = CLIPConfig(
        text_config={"vocab_size": vocab_size, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                     "num_attention_heads": 4, "max_position_embeddings": 32, "bos_token_id": 0, "eos_token_id": 2,
                     "pad_token_id": 0},
        vision_config={"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
                       "image_size": image_size, "patch_size": 8},
        projection_dim=32,
    )  # fmt: skip
    torch.manual_seed(seed)
    return CLIPModel(cfg).eval()


def make_pairs(folder: Path, count: int = 6, seed: int = 0) -> Path:
    """`count` small random RGB images (PNG, two sizes) with word captions in captions.tsv."""
    from PIL import Image

    folder.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    lines = []
    for i in range(count):
        size = (40, 48) if i % 2 else (48, 40)
        pixels = torch.randint(0, 256, (size[1], size[0], 3), generator=g, dtype=torch.uint8).numpy()
        Image.fromarray(pixels).save(folder / f"img{i}.png")
        lines.append(f"img{i}.png\t" + " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 8))))
    (folder / "captions.tsv").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return folder
