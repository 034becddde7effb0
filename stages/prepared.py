"""Examples prepared once per node and stage run: tokenized over the node's cores into Arrow files cached by content,
which every rank memory-maps and reads its batches from (TRL and veRL tokenize with `datasets.map` as here;
OpenRLHF tokenizes in every rank).

A stage's `encode_rows(cfg, tokenizer, rows) -> data.Encoded` turns rows into token ids. `prepare` runs it with
`Dataset.map` over chunks of BATCH_ROWS rows, in several processes once the rows pay for them, and writes the
result under the datasets cache (`$HF_DATASETS_CACHE/rlhf-examples`), named by a fingerprint of all that decides
it: the rows (datasets' fingerprint of the loaded, mixed and cut data: another file content, split or
--max_samples is another fingerprint), the tokenizer (vocabulary, settings, chat template), the config fields the
stage's encoding reads (its EXAMPLE_FIELDS) and the source of the encoding code. A retried or resumed stage, and a
night whose data did not change, find the files and start training without tokenizing. Held as Arrow, an example
costs its token ids' bytes on disk and nothing in a rank's Python heap until its batch is read. Files no stage has
used for RLHF_EXAMPLE_CACHE_DAYS days (default 7) are removed when a stage prepares its examples, so that nights
of changing data do not fill the disk.

Rows that leave nothing to train on are counted over the whole dataset (`data.check_dropped`): logged by row, and
an error when no row fits.
"""

from __future__ import annotations

import gc
import hashlib
import inspect
import os
import resource
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import datasets
import numpy as np
from datasets.fingerprint import Hasher
from datasets.utils import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars

from stages import data
from stages.environment import stage_environment

PREPARED_FORMAT = 1  # the layout of the files; a change makes every cached preparation miss
BATCH_ROWS = 1_000  # rows encoded at a time by one process: its memory, whatever the dataset's size
PARALLEL_FROM_ROWS = 20_000  # fewer rows encode faster in this process than worker processes start
MAX_PROCESSES = 32
BAR_FROM_ROWS = 5_000  # fewer rows tokenize in seconds: the summary line says it all, a progress bar fills the log

Encoder = Callable[[Any, Any, datasets.Dataset], data.Encoded]


class ExampleRows(Sequence):
    """Prepared examples as the trainers index them: `rows[i]` a dict of Python values, a slice or `take` a list."""

    def __init__(self, table: datasets.Dataset):
        self.table = table

    def __len__(self) -> int:
        return len(self.table)

    def __getitem__(self, index):
        if isinstance(index, slice):
            return self.take(range(len(self))[index])
        return self.table[index]

    def __iter__(self):
        for start in range(0, len(self), BATCH_ROWS):
            yield from self.take(range(start, min(start + BATCH_ROWS, len(self))))

    def take(self, indices: Sequence[int]) -> list[dict]:
        if len(indices) == 0:
            return []
        columns = self.table[list(indices)]
        return [dict(zip(columns, values)) for values in zip(*columns.values())]


@dataclass
class Preparation:
    examples: ExampleRows
    rows: int
    seconds: float
    cached: bool
    processes: int
    peak_memory_gib: float  # this process's peak plus that of the largest encoding process it started

    def summary(self, what: str) -> str:
        if self.cached:
            return (f"{what}: {len(self.examples)} examples of {self.rows} rows from the cache of prepared examples "
                    f"({self.seconds:.1f} s)")
        return (f"{what}: {len(self.examples)} examples of {self.rows} rows tokenized in {self.seconds:.1f} s "
                f"({self.rows / max(self.seconds, 1e-9):.0f} rows/s, {self.processes} process(es), peak memory "
                f"{self.peak_memory_gib:.1f} GiB)")


def cache_dir() -> Path:
    return Path(datasets.config.HF_DATASETS_CACHE) / "rlhf-examples"


def fingerprint(encode: Encoder, cfg, fields: Sequence[str], tokenizer, rows: datasets.Dataset) -> str:
    """What decides the examples of `rows`, as a file name."""
    import tokenizers
    import transformers

    code = hashlib.sha256()
    for module in sorted({inspect.getsourcefile(encode), inspect.getsourcefile(data)}):
        code.update(Path(module).read_bytes())
    return Hasher.hash([PREPARED_FORMAT, rows._fingerprint, Hasher.hash(tokenizer), transformers.__version__,
                        tokenizers.__version__, {name: getattr(cfg, name) for name in fields}, code.hexdigest()])


def processes_for(rows: int) -> int:
    """Encoding processes: the cores this process may use (RLHF_CPU_CORES caps them), for rows worth it."""
    cores = len(os.sched_getaffinity(0))
    cores = min(cores, stage_environment().cpu_cores or cores)
    return max(1, min(cores, MAX_PROCESSES, rows // (PARALLEL_FROM_ROWS // 2))) if rows >= PARALLEL_FROM_ROWS else 1


def prepare(encode: Encoder, cfg, fields: Sequence[str], tokenizer, rows: datasets.Dataset, *,
            what: str = "examples", report: bool = True) -> Preparation:
    """The examples of `rows`, from the cache or encoded now (and cached). `report`: name the rows that do not fit
    (and refuse a dataset of which none fits); False for the ranks that open what their node's first rank reported."""
    started = time.perf_counter()
    key = fingerprint(encode, cfg, fields, tokenizer, rows)
    processes = processes_for(len(rows))
    directory = cache_dir()
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{key}.arrow"
    shards = ([path] if processes == 1 else
              [directory / f"{key}_{rank:05d}_of_{processes:05d}.arrow" for rank in range(processes)])
    cached = all(shard.exists() for shard in shards)
    if cached:
        for shard in shards:
            os.utime(shard)  # used now: kept for another RLHF_EXAMPLE_CACHE_DAYS
    bar_off = (nullcontext() if len(rows) >= BAR_FROM_ROWS else
               _off_inside(lambda: not are_progress_bars_disabled(), disable_progress_bars, enable_progress_bars))
    with bar_off:
        encoded = rows.map(
            _encode_batch, fn_kwargs={"encode": encode, "cfg": cfg, "tokenizer": tokenizer, "features": rows.features},
            batched=True, batch_size=BATCH_ROWS, remove_columns=rows.column_names, num_proc=None if processes == 1
            else processes, cache_file_name=str(path), new_fingerprint=key, desc=f"tokenizing {what}",
        )
    fits = encoded.data.column("fits").to_numpy()  # the map's own table: no index mapping over it
    if not fits.all():
        if report:
            # Only the encoder knows how it names its examples and why a row does not fit: it says so for row 0.
            probe = encode(cfg, tokenizer, rows.select(range(1)))
            data.check_dropped(probe.kind, np.flatnonzero(~fits).tolist(), len(fits), probe.reason)
        encoded = encoded.select(np.flatnonzero(fits))
    encoded = encoded.remove_columns("fits")
    data.remove_unused(directory, "*.arrow", stage_environment().example_cache_days * 86_400)
    peak = sum(resource.getrusage(who).ru_maxrss for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))
    return Preparation(ExampleRows(encoded), len(rows), time.perf_counter() - started, cached, processes,
                       peak / 2**20)


def prepare_prompts(cfg, tokenizer, rows: datasets.Dataset, *, stage: str, what: str = "prompts") -> ExampleRows:
    """Prompt rows (the RL stage's, the evaluation's) as examples, prepared in this process, its summary printed."""
    preparation = prepare(data.encode_prompt_rows, cfg, data.PROMPT_FIELDS, tokenizer, rows, what=what)
    print(f"[{stage}] {preparation.summary(what)}", flush=True)
    return preparation.examples


@contextmanager
def _off_inside(enabled: Callable[[], bool], disable: Callable[[], None], enable: Callable[[], None]) -> Iterator[None]:
    """A switch (Python's cycle collector, datasets' progress bars) off for what runs inside and on again after,
    unless it was off already."""
    if not enabled():
        yield
        return
    disable()
    try:
        yield
    finally:
        enable()


def _encode_batch(batch: dict[str, list], *, encode: Encoder, cfg, tokenizer, features) -> dict[str, list]:
    """One chunk of rows as columns of examples (token ids as int32, masks as int8) and whether each fits."""
    # A chunk's encoding allocates hundreds of thousands of lists, none in a cycle, and the collections they set off
    # took a fifth of its time (measured: 1,527 pairs/s with them, 1,897 without); what cycles it leaves are
    # collected after.
    with _off_inside(gc.isenabled, gc.disable, gc.enable):
        return _encoded_columns(encode(cfg, tokenizer, datasets.Dataset.from_dict(batch, features=features)))


def _encoded_columns(encoded: data.Encoded) -> dict[str, list]:
    columns: dict[str, list] = {"fits": encoded.fits}
    for name in encoded.examples[0]:
        values = [example[name] for example in encoded.examples]
        if isinstance(values[0], list):
            dtype = np.int8 if name.endswith("mask") else np.int32
            values = [np.asarray(value, dtype=dtype) for value in values]
        columns[name] = values
    return columns
