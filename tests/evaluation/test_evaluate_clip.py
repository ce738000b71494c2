"""The clip task on a tiny CLIP built from a config: image-caption pairs, FP8 candidates online and from a
checkpoint, figures against an independent computation, and bad pair files."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from evaluation_fixtures import make_pairs, make_tokenizer, save, tiny_clip

from mixprec.cli import main
from mixprec.errors import MixprecError
from mixprec.evaluation import evaluate
from mixprec.evaluation.clip import read_pairs

pytest.importorskip("PIL")


@pytest.fixture(scope="module")
def clip_env(tmp_path_factory):
    root = tmp_path_factory.mktemp("clip")
    tok = make_tokenizer()
    return {
        "clip": save(tiny_clip(len(tok)), tok, root / "clip"),
        "pairs": make_pairs(root / "pairs"),
        "tok": tok,
    }


def _independent(clip_dir, pairs_dir, tok, quantize: bool):
    """Image and text embeddings of every pair, computed here with the model's own get_*_features."""
    from PIL import Image
    from transformers import CLIPImageProcessorPil, CLIPModel

    import mixprec

    model = CLIPModel.from_pretrained(clip_dir).eval()
    if quantize:
        mixprec.quantize_model_(model, "fp8-dynamic")
    proc = CLIPImageProcessorPil(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    images, texts = [], []
    with torch.no_grad():
        for line in (pairs_dir / "captions.tsv").read_text().splitlines():
            name, caption = line.split("\t")
            px = proc(images=[Image.open(pairs_dir / name).convert("RGB")], return_tensors="pt")[
                "pixel_values"
            ]
            ids = torch.tensor([tok(caption)["input_ids"]])
            images.append(model.get_image_features(pixel_values=px).pooler_output[0])
            texts.append(model.get_text_features(input_ids=ids).pooler_output[0])
    return torch.stack(images), torch.stack(texts)


def test_clip_fp8_online_and_checkpoint_agree_with_independent_embeddings(clip_env, tmp_path):
    import mixprec

    r = evaluate(clip_env["clip"], candidate_scheme="fp8-dynamic", data=clip_env["pairs"], samples=6,
                 batch_size=4, progress=False)  # fmt: skip
    assert r.settings["tasks"] == ["clip"] and r.data["samples_used"] == {"clip": 6}
    clip = r.tasks["clip"]
    ref_img, ref_txt = _independent(clip_env["clip"], clip_env["pairs"], clip_env["tok"], quantize=False)
    cand_img, cand_txt = _independent(clip_env["clip"], clip_env["pairs"], clip_env["tok"], quantize=True)
    img_cos = F.cosine_similarity(ref_img, cand_img)
    txt_cos = F.cosine_similarity(ref_txt, cand_txt)
    change = F.cosine_similarity(cand_img, cand_txt) - F.cosine_similarity(ref_img, ref_txt)
    assert r.per_sample["clip.image_cosine"] == pytest.approx(img_cos.tolist(), abs=1e-5)
    assert r.per_sample["clip.text_cosine"] == pytest.approx(txt_cos.tolist(), abs=1e-5)
    assert clip["similarity_change"] == pytest.approx(change.mean().item(), abs=1e-5)
    assert 0.95 < clip["image_embedding_cosine"] < 1 and 0.95 < clip["text_embedding_cosine"] < 1
    for figure in (
        "similarity_change",
        "clip_score_change",
        "image_embedding_cosine",
        "text_embedding_cosine",
    ):
        iv = clip["intervals"][figure]
        assert iv["low"] <= clip[figure] <= iv["high"] and iv["samples"] == 6
    # the vision tower's patch embedding (a convolution) and every norm stay in high precision
    assert r.candidate["scheme"] == "fp8-dynamic"

    # the same scheme written to a checkpoint (vision tower included) and loaded back: the same figures
    q = tmp_path / "clip-fp8"
    mixprec.inference.quantize_checkpoint(clip_env["clip"], q, scheme="fp8-dynamic")
    out = tmp_path / "clip.json"
    assert main(["evaluate", "--reference", str(clip_env["clip"]), "--candidate", str(q), "--data",
                 str(clip_env["pairs"]), "--samples", "6", "--batch-size", "4", "--no-progress",
                 "--json", str(out)]) == 0  # fmt: skip
    doc = json.loads(out.read_text())
    assert doc["candidate"]["scheme"] == "fp8-dynamic" and doc["candidate"]["kind"] == "image-text"
    assert doc["tasks"]["clip"]["image_embedding_cosine"] == pytest.approx(
        clip["image_embedding_cosine"], abs=1e-9
    )
    assert doc["tasks"]["clip"]["similarity_change"] == pytest.approx(clip["similarity_change"], abs=1e-9)


def test_pair_files_and_their_errors(clip_env, tmp_path):
    pairs, source = read_pairs(clip_env["pairs"])
    assert len(pairs) == 6 and pairs[0].image.name == "img0.png" and source == str(clip_env["pairs"])
    listed = tmp_path / "pairs.jsonl"
    listed.write_text(json.dumps({"image": str(clip_env["pairs"] / "img1.png"), "text": "a grid"}) + "\n")
    assert read_pairs(listed)[0][0].caption == "a grid"
    (tmp_path / "empty").mkdir()
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "captions.tsv").write_text("missing.png\ta caption\n")
    (tmp_path / "notimg").mkdir()
    (tmp_path / "notimg" / "x.png").write_text("not an image")
    (tmp_path / "notimg" / "captions.tsv").write_text("x.png\tcaption\n")
    (tmp_path / "notab").mkdir()
    (tmp_path / "notab" / "captions.tsv").write_text("x.png caption without a tab\n")
    for path, message in ((tmp_path / "empty", "no captions file"), (tmp_path / "bad", "does not exist"),
                          (tmp_path / "notimg", "not an image"), (tmp_path / "notab", "TAB"),
                          (tmp_path / "x.txt", "does not exist")):  # fmt: skip
        with pytest.raises(MixprecError, match=message):
            read_pairs(path)
    with pytest.raises(MixprecError, match="fewer than --samples 7"):
        evaluate(clip_env["clip"], clip_env["clip"], data=clip_env["pairs"], samples=7, progress=False)
    with pytest.raises(MixprecError, match="does not apply"):
        evaluate(clip_env["clip"], clip_env["clip"], data=clip_env["pairs"], task="embed", progress=False)
