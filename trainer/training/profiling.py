"""torch.profiler over a few optimizer steps (``performance.profile_from``/``profile_steps``): where a step's time
goes, per process, without a separate harness.

Each process writes two files into the run folder's ``profile/``: ``rank<N>-steps<A>-<B>.trace.json``, the
timeline (host ops, CUDA kernels, the gaps between them; open it in Perfetto or chrome://tracing), and
``rank<N>-steps<A>-<B>.txt``, the ops and kernels by their own time (device time where there is a GPU). A resumed
run that profiles the same steps again writes ``...-2`` beside them. Profiling slows the steps it covers;
their log records say so with the rest of the run's numbers, so read their tokens/s with that in mind."""

from __future__ import annotations

from pathlib import Path

import torch

from trainer.runfolder import PROFILE_DIR as FOLDER


class StepProfiler:
    """Starts before step ``first`` and writes its files after step ``first + count - 1``."""

    def __init__(self, output_dir: Path, rank: int, first: int, count: int) -> None:
        self.folder, self.rank = Path(output_dir) / FOLDER, rank
        self.first, self.last = first, first + count - 1
        self.profiler = None

    def before(self, step: int) -> None:
        """Called with the number of the step about to run."""
        if self.first and step == self.first:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if torch.cuda.is_available():
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self.profiler = torch.profiler.profile(activities=activities, record_shapes=False)
            self.profiler.__enter__()

    def after(self, step: int) -> None:
        """Called with the number of the step that just ran."""
        if self.profiler is not None and step >= self.last:
            self.write()

    def close(self, step: int) -> None:
        """The run ended inside the profiled steps (its last step, a signal): write what was recorded."""
        if self.profiler is not None:
            self.last = step
            self.write()

    def write(self) -> None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self.profiler.__exit__(None, None, None)
        self.folder.mkdir(parents=True, exist_ok=True)
        stem = self.free_stem(f"rank{self.rank}-steps{self.first}-{self.last}")
        self.profiler.export_chrome_trace(str(self.folder / f"{stem}.trace.json"))
        sort = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
        table = self.profiler.key_averages().table(sort_by=sort, row_limit=60)
        (self.folder / f"{stem}.txt").write_text(
            f"steps {self.first}-{self.last}, process {self.rank}, sorted by {sort}\n{table}\n"
        )
        print(f"profile: steps {self.first}-{self.last} written to {self.folder / stem}.*", flush=True)
        self.profiler = None

    def free_stem(self, stem: str) -> str:
        """``stem``, or ``stem-2``, ``-3``... where a resumed run profiled the same steps before: never
        overwritten."""
        taken, n = stem, 1
        while (self.folder / f"{taken}.txt").exists() or (self.folder / f"{taken}.trace.json").exists():
            n += 1
            taken = f"{stem}-{n}"
        return taken
