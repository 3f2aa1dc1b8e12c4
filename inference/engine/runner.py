"""A run of the model for a command: the loaded model and what its batches share (the budget, speculative
options, CUDA graphs, timings, the record file). generate.py's batch mode and chat generate from it, its
scoring mode scores from it."""
import json
import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import torch

from .batch import Budget
from .errors import InputError
from .generation import StepHook, Stats, generate
from .prompts import Completion, Prompt, batch_of, finish_completion
from .scoring import ScoreJob, ScoreOutputs, score_to_file
from .session import Loaded
from .speculative import SpecOptions, SpecStats, speculative_generate_batch


@dataclass
class Runner:
    """A loaded model (session.Loaded) and what the batches of one run share: the budget, the speculative
    options and statistics, the decode steps' CUDA graphs, timings and the JSONL record file (rank 0 only;
    None elsewhere). Generation, speculative generation and scoring run from it."""
    loaded: Loaded
    budget: Budget
    spec: Optional[SpecOptions] = None
    records: Any = None
    graphs: Any = None                        # decode steps as CUDA graphs (cuda_graph.GraphedDecode)
    stats: Stats = field(default_factory=Stats)
    spec_stats: SpecStats = field(default_factory=SpecStats)
    busy_s: float = 0.0                       # seconds inside run(): generating, not waiting for input

    @property
    def model(self):
        return self.loaded.model

    @property
    def tokenizer(self):
        return self.loaded.session.tokenizer

    @property
    def rank(self) -> int:
        return self.loaded.session.par.rank

    @property
    def eos_id(self) -> int:
        return self.budget.eos_id

    def finish(self, seconds: float, label: str = "total") -> List[str]:
        """Close what the run opened; the summary lines: timings (`label` `seconds`), the weight stream's
        figures, speculation."""
        if self.records is not None:
            self.records.close()
        lines = [f"{self.stats.summary()}; {label} {seconds:.2f} s"]
        if self.graphs is not None:
            lines.append(self.graphs.summary())
        if self.model.weight_stream is not None:
            lines.append(self.model.weight_stream.close())
        if self.spec is not None:
            k = self.spec.k or self.model.args.dspark_block_size
            lines.append(self.spec_stats.summary(self.spec.verify, k))
        return lines

    def complete(self, prompts: List[Prompt],
                 on_step: Optional[StepHook] = None) -> Tuple[List[List[int]], List[str]]:
        """One batch of prepared prompts -> completion ids and finish reasons, plainly or (with `spec`) by
        the speculative loop, whose statistics are added to spec_stats; timings go to stats. `on_step`: see
        generate(); the speculative loop calls it once per committed position."""
        batch = batch_of(prompts)
        if self.spec is None:
            return generate(self.model, batch, self.budget, self.stats, self.graphs, on_step)
        try:
            completions, reasons, st = speculative_generate_batch(self.model, batch, self.budget, self.spec,
                                                                  on_step=on_step)
        except ValueError as e:
            raise InputError(str(e)) from None
        self.spec_stats.add(st)
        self.stats.add("prefill", st.prefill_tokens, st.prefill_s)
        self.stats.add("decode", max(0, st.new_tokens - len(prompts)), st.decode_s)  # first: the prefill's
        return completions, reasons

    def run_all(self, prompts: List[Prompt], max_batch_size: int):
        """-> (prompt, completion or None off rank 0), in order. Prompts with images run one at a time (every
        span must fit in the prefill chunk), text prompts in batches of max_batch_size."""
        size = 1 if any(p.images for p in prompts) else max_batch_size
        for start in range(0, len(prompts), size):
            chunk = prompts[start:start + size]
            yield from zip(chunk, self.run(chunk, [f"prompt {start + n + 1}" for n in range(len(chunk))]))

    def run(self, prompts: List[Prompt], names: List[str], always_warn: bool = False,
            on_step: Optional[StepHook] = None) -> List[Optional[Completion]]:
        """One batch on every rank; rank 0 gets the parsed completions (and writes their records), the
        other ranks None. Unparsable replies get a warning when they ended with EOS, or always_warn.
        on_step: see generate()."""
        start = time.perf_counter()
        try:
            ids, reasons = self.complete(prompts, on_step)
        finally:
            self.busy_s += time.perf_counter() - start
        if self.rank != 0:
            return [None] * len(prompts)
        done = []
        for prompt, completion, reason, name in zip(prompts, ids, reasons, names):
            c = finish_completion(self.tokenizer, prompt, completion, reason, name,
                                  always_warn or reason == "eos", self.budget.max_new_tokens)
            if self.records is not None:
                self.records.write(json.dumps(c.record, ensure_ascii=False) + "\n")
                self.records.flush()
            done.append(c)
        return done

    def score(self, job: ScoreJob, out: ScoreOutputs, metadata: Dict[str, str]) -> Dict[str, torch.Tensor]:
        """Scoring mode: the job's teacher-forced logits written to out.dump (rank 0, atomically), with the
        outputs `out` asks for; -> the dump's tensors."""
        return score_to_file(self.model, job, out, metadata, self.stats, self.budget.prefill_chunk)
