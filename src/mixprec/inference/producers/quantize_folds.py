"""The fold stage of an offline quantization (`--algorithm rotate`, `smoothquant`, `awq`): transforms
of the weights that leave the model's function unchanged in exact arithmetic and make it easier to
round. They run first, in the order rotate -> smoothquant -> awq (spec.RUN_ORDER). Calibration and
GPTQ then see the folded model.

Each fold streams the checkpoint one block at a time (rotation_checkpoint.py, fold_checkpoint.py: the
tensors the folds give a loaded model, bit for bit) and writes the folded checkpoint in its own dtype
(safetensors, with the input's side files) to a temporary directory beside the output; a fold after it
reads that one. The rest of the pipeline reads the last as its input, and every one is removed when the
quantization ends, however it ends. The written checkpoint is an ordinary one (rotation unties a tied
head: config.json says so), served unchanged by the engines. Memory: one block at a time, as the other
stages; disk: up to two folded copies of the model at once.
"""

from __future__ import annotations

import dataclasses
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from mixprec.conversion import ConversionReport
from mixprec.hf import load_tokenizer
from mixprec.inference.algorithms.fold_checkpoint import awq_checkpoint, smoothquant_checkpoint
from mixprec.inference.algorithms.fold_stage import fold_names, folds_need_data
from mixprec.inference.algorithms.rotation_checkpoint import rotate_checkpoint
from mixprec.inference.algorithms.spec import ROTATE, SMOOTHQUANT
from mixprec.inference.calibration.across_ranks import broadcast_object
from mixprec.inference.calibration.data import token_batches, tokens_sha256
from mixprec.inference.checkpoint.safetensors_io import open_checkpoint
from mixprec.inference.producers.quantize_job import QuantizeJob, Selection, Source, read_source_config
from mixprec.inference.producers.resume import PartialRun
from mixprec.ranks import is_main_process


@contextmanager
def folded(job: QuantizeJob, source: Source, report: ConversionReport,
           selection_of: Callable[[QuantizeJob, Source], Selection],
           run: PartialRun | None = None) -> Iterator[tuple[QuantizeJob, Source]]:  # fmt: skip
    """(the job and source the rest of the pipeline reads): the input itself when no fold is asked,
    else the folded model's temporary directory, removed on exit; the folds' records in the report's
    `algorithm` (`folds`). selection_of(job, source): the Linears and their schemes (AWQ rounds each
    with its own). run: a resumable quantization's partial run, which keeps the folded model (in its
    work directory, removed with it) and its record, and hands back what an earlier run folded."""
    folds = fold_names(job.algorithm)
    if not folds:
        yield job, source
        return
    if run is None:
        tmp = Path(tempfile.mkdtemp(prefix=f".{job.output_dir.name}.folded-", dir=job.output_dir.parent))
    else:
        tmp = run.folded_dir
    try:
        record = run.folds_record() if run is not None else None
        if record is None:
            # split across ranks (quantize_ranks.py) rank 0 folds into the shared work directory and
            # the others read its result
            if is_main_process():
                shutil.rmtree(tmp, ignore_errors=True)
                tmp.mkdir()
                record = _fold_into(job, source, selection_of(job, source), tmp)
                if run is not None:
                    run.save_folds(record)
            record = broadcast_object(record, src=0)
        report.algorithm = {**job.algorithm.to_dict(), "folds": record}
        report.notes.append(f"folded ({', '.join(folds)}) before calibration; the folded model was written "
                            "to a temporary directory and read from there")  # fmt: skip
        new_job = dataclasses.replace(job, model_dir=tmp)
        yield new_job, Source(open_checkpoint(tmp), read_source_config(tmp), source.texts)
    finally:
        if run is None:
            shutil.rmtree(tmp, ignore_errors=True)


def _fold_into(job: QuantizeJob, source: Source, selection: Selection, tmp: Path) -> dict[str, Any]:
    """Fold in run order over the checkpoint, block by block, the last fold writing `tmp`; each fold's
    record (JSON-ready). Each fold reads the one before's output, a directory beside `tmp` removed once
    read (rotation_checkpoint.py, fold_checkpoint.py: the tensors of the folds on a loaded model, bit
    for bit)."""
    folds, params = fold_names(job.algorithm), job.algorithm.folds
    batches = None
    if folds_need_data(job.algorithm):
        batches = token_batches(
            source.texts, load_tokenizer(job.model_dir), job.calib_samples, job.calib_seq_len
        )
    schemes = {n: selection.schemes[n] for n in selection.targets}
    record: dict[str, Any] = {}
    source_dir, intermediate = job.model_dir, []
    try:
        for i, fold in enumerate(folds):
            out = tmp if i == len(folds) - 1 else tmp.with_name(f"{tmp.name}.{fold}")
            if out != tmp:
                intermediate.append(out)
            out.mkdir(exist_ok=True)
            if fold == ROTATE:
                record[fold] = rotate_checkpoint(source_dir, out, seed=params.seed, r2=params.r2)
            elif fold == SMOOTHQUANT:
                record[fold] = smoothquant_checkpoint(source_dir, out, batches, alpha=params.alpha)
            else:
                record[fold] = awq_checkpoint(source_dir, out, batches, schemes, n_grid=params.n_grid,
                                              scales=params.awq_scales)  # fmt: skip
            if fold != ROTATE:  # the data folds name their tokens, as fold_model_ records them
                record[fold]["data_sha256"] = tokens_sha256(batches)
            if source_dir in intermediate:  # read: at most two folded copies on disk at a time
                shutil.rmtree(source_dir, ignore_errors=True)
            source_dir = out
    finally:
        for d in intermediate:
            shutil.rmtree(d, ignore_errors=True)
    return record


__all__ = ["folded"]
