"""Generator: the one entry point of decoding (vanilla AR and speculative trees), batched.

The engine speaks the model contract (adt_core/families/contract.py): the bundle's family gives
prompt rows (cond, then uncond with CFG; each row its own length), a layout and an image
vocabulary. A row r holds its prompt entries 0 .. base[r] - 1, then image index i at sequence
position base[r] + layout.offset(i); the target's output one position earlier predicts it (the
last prompt entry predicts index 0). The engine works in image-index and code space: the
models read ids (`ImageVocab.to_id`) and give logits over codes. What each family's rows and
layout are is its own folder's business (adt_core/families/<family>/prompt.py); the engine reads
only the contract.

A Generator fixes, once, everything a decode needs (`DecodeSetup`: the sampler strategy, the
drafter's scorer, the cost table of the cost budget, LANTERN's relaxation) and streams prompts
through a `BatchDecoder` (adt_core/round/decoder.py): up to `DecodeConfig.batch_size` images in flight, a
prompt entering as soon as a slot frees (continuous refill). With the coupled sampler (or greedy)
every image's tokens are a function of its prompt, seed and config only: not of the method, the
batch or the order of prompts.
"""

from __future__ import annotations

import weakref
from collections import deque
from dataclasses import replace
from typing import Iterator

import torch

from adt_core.bundles.bundle import Bundle
from adt_core.calibrate import (CostTable, Timer, batch_sizes, key_costs, measure_draft_cost, measure_target_cost,
                                typical_prefix)
from adt_core.config import DecodeConfig, SamplingConfig
from adt_core.kv_cache import CacheStore
from adt_core.results import GenerationResult, PromptFailure, estimate_speedup
from adt_core.round.decoder import BatchDecoder, DecodeSetup
from adt_core.round.draft import DraftScorer
from adt_core.round.neighbours import ImagePrior
from adt_core.round.sampler import Sampler
from adt_core.round.verify import Relaxation

# measured target costs: model -> {(device, dtype, rows): table}; entries die with the model
_COSTS: "weakref.WeakKeyDictionary[torch.nn.Module, dict[tuple, CostTable]]" = weakref.WeakKeyDictionary()
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class Generator:
    def __init__(self, bundle: Bundle, config: DecodeConfig) -> None:
        self.bundle, self.config = bundle, config
        self.device = torch.device(config.device)
        self.dtype = DTYPES[config.dtype]
        self.sampling: SamplingConfig = config.sampling(bundle.sampling)
        self.cfg_rows = 2 if self.sampling.use_cfg else 1
        self.prompter = bundle.make_prompter()  # the family's prompter checks its parts agree
        self.layout, self.vocab = self.prompter.layout, self.prompter.vocab
        if config.needs_drafter and bundle.drafter is None:
            raise ValueError(f"method {config.method!r} needs a drafter; bundle {bundle.name!r} has none")
        n = self.layout.num_codes
        self.num_tokens = n if config.max_tokens is None else min(config.max_tokens, n)
        self.timer = Timer(self.device)
        self._relax: Relaxation | None = None
        self._costs: CostTable | None = None
        self._planners: dict = {}  # what each capacity's round planner learned, kept across calls
        self._store = CacheStore()  # the last decoder's KV caches, taken by the next one of their shape
        # what draws the tokens, picked once: argmax (greedy), fixed Gumbel noise (coupled) or generators
        self.sampler = Sampler.pick(self.sampling, config.sampler, self.vocab.num_codes)
        coupled = self.sampling if self.sampler.kind == "coupled" else None
        # the drafter-free method's neighbour odds and continuations, learned over every image decoded
        self.prior = ImagePrior(self.vocab.num_codes, self.device) if config.method == "jacobi" else None
        self.scorer = DraftScorer(coupled, perturbed=config.draft_score == "perturbed")

    # ---- public -------------------------------------------------------------------------
    def generate(self, prompts: list[str], seeds: list[int]) -> list[GenerationResult]:
        """Every prompt's image, in input order (raises the first prompt failure)."""
        out: list[GenerationResult | None] = [None] * len(prompts)
        for i, r in self.stream(prompts, seeds):
            if isinstance(r, PromptFailure):
                raise r.error
            out[i] = r
        return out  # type: ignore[return-value]

    def stream(self, prompts: list[str], seeds: list[int]) -> Iterator[tuple[int, GenerationResult | PromptFailure]]:
        """Yield (input index, result) as images finish, up to `batch_size` in flight; a free
        slot takes the next prompt at once. A prompt whose rows cannot be made (encoded,
        tokenized) yields a PromptFailure and the others go on."""
        for done in self.rounds(prompts, seeds):
            yield from done

    @torch.inference_mode()
    def rounds(self, prompts: list[str], seeds: list[int]) -> Iterator[list[tuple[int, GenerationResult | PromptFailure]]]:
        """`stream` one round at a time: after every admission or round, the (index, result)
        pairs it finished (often none). A caller can interleave the rounds of several
        Generators (the throughput benchmark times methods this way)."""
        if len(prompts) != len(seeds):
            raise ValueError(f"{len(prompts)} prompts but {len(seeds)} seeds")
        if not prompts:
            return
        cap = min(self.config.batch_size, len(prompts))
        dec = self.decoder(cap)
        try:
            yield from self._run(dec, prompts, seeds)
        finally:
            dec.release()

    def _run(self, dec: BatchDecoder, prompts: list[str], seeds: list[int]):
        cap = dec.capacity
        queue = deque((i, p, int(s)) for i, (p, s) in enumerate(zip(prompts, seeds)))
        ready: list[tuple[int, str, int]] = []  # items encoded ahead (rows[used:] are theirs)
        rows, used = None, 0
        while queue or ready or dec.active():
            free = len(dec.free())
            if free and (ready or queue) and dec.admits_now(len(ready) + len(queue)):
                failed = []
                if not ready:  # the next `cap` prompts at once: slots free up a few at a time, and the
                    # encoder's cost per prompt falls with its batch (rows are batch-invariant)
                    ready, rows, failed = self._encode([queue.popleft() for _ in range(min(cap, len(queue)))])
                    used = 0
                n = min(free, len(ready))
                items, ready = ready[:n], ready[n:]
                part = rows if used == 0 and not ready else rows.select(used, used + n)
                used += n
                yield failed + (list(self._finish(dec.admit(items, part))) if items else [])
                continue
            done = list(self._finish(dec.step(held=bool(free and (ready or queue)))))
            if not (queue or ready):
                dec.narrow()  # the tail: its images go on in fewer slots
            yield done

    def reserve(self, capacity: int) -> None:
        """Make the caches of a `capacity`-slot decoder now, kept for the next call that holds that
        many images (a call of at least `batch_size` prompts); the benchmarks reserve before they
        time, a one-off cost as calibration is."""
        self.decoder(capacity).release()

    def release(self) -> None:
        """Drop the caches kept between calls (memory for something else; the next call makes new ones)."""
        self._store.release()

    def decoder(self, capacity: int) -> BatchDecoder:
        """A BatchDecoder of `capacity` slots over this Generator's fixed set-up."""
        self._place_models()
        costs = self.cost_table() if self.config.cost_sized else None
        setup = DecodeSetup(self.bundle, self.config, self.sampler, self.scorer, self.cfg_rows, self.num_tokens,
                            self.device, self.timer, costs, self.relaxation(), self._planners, self.prompter,
                            self._max_prompt(), self.prior, self._store)
        return BatchDecoder(setup, capacity)

    # ---- shared steps -------------------------------------------------------------------
    def _max_prompt(self) -> int:
        """The longest prompt row a decoder must hold: the prompter's `max_prompt` (the family
        contract's bound on a prompt's cache entries)."""
        return int(self.prompter.max_prompt)

    def _encode(self, items):
        """Prompt rows for (index, prompt, seed) items; a prompt that fails alone is dropped and
        yielded as a failure."""
        cfg = self.cfg_rows == 2
        try:
            return items, self.prompter.rows([p for _, p, _ in items], cfg), []
        except Exception:  # noqa: BLE001 - find the prompt(s) that fail, keep the others
            ok, failed = [], []
            for it in items:
                try:
                    self.prompter.rows([it[1]], cfg)
                    ok.append(it)
                except Exception as err:  # noqa: BLE001
                    failed.append((it[0], PromptFailure(it[1], it[2], err)))
            if not ok:
                return [], None, failed
            return ok, self.prompter.rows([p for _, p, _ in ok], cfg), failed

    def _finish(self, done) -> Iterator[tuple[int, GenerationResult]]:
        """VQ-decode finished images one at a time and hand them out. One at a time: the memory
        plan holds one image's decode (`memory.decode_workspace`), and an image's pixels must not
        depend on which images finished with it: a VQ decoder's convolutions are not batch-invariant
        (emoji16 on a CPU: 64 images decoded together differed from each decoded alone by 1 in 13
        channel values; 4 or 8 together in 5), so `ar`'s waves and a speculative method's one-by-one
        finishes gave the same tokens but not the same bytes. On a CPU (emoji16, one thread) an image
        alone takes 26 ms, 19 ms each in groups of 8 and 37 ms each in a group of 64."""
        if not done:
            return
        h, w = self.layout.grid_h, self.layout.grid_w
        grid = torch.stack([d.tokens for d in done]).view(-1, h, w)
        # n x (H*f, W*f, 3) uint8
        images = [self.bundle.vq.decode(grid[i:i + 1].to(self.device)).cpu().numpy()[0] for i in range(len(done))]
        costs = self.cost_table() if self.config.method != "ar" else None
        for i, d in enumerate(done):
            if costs is not None:
                d.stats.estimated_speedup = estimate_speedup(d.stats, costs, self.num_tokens, d.stats.batch_size)
            else:
                d.stats.estimated_speedup = 1.0
            yield d.index, GenerationResult(d.prompt, d.seed, grid[i].cpu(), images[i], d.stats)

    def _place_models(self) -> None:
        b = self.bundle
        for m in (b.target, b.drafter):
            if m is not None:
                m.to(self.device, self.dtype)
        b.vq.to(self.device, torch.float32)

    def cost_table(self) -> CostTable:
        """Target forward and draft level cost vs total tokens on this device/dtype at this batch
        size, measured once per model and cached (or set with `use_costs`, e.g. from job outputs)."""
        if self._costs is not None:
            return self._costs
        per_model = _COSTS.setdefault(self.bundle.target, {})
        key = (str(self.device), self.config.dtype, self.cfg_rows, self.config.batch_size)
        if key not in per_model:
            self._place_models()
            sizes = batch_sizes(self.config.batch_size)
            prefix = typical_prefix(self.prompter)
            table = measure_target_cost(self.bundle.target, rows=self.cfg_rows, sizes=sizes, repeats=3, warmup=1,
                                        slots=self.config.batch_size, prefix_len=prefix)
            keys, slope = key_costs(self.bundle.target, self.cfg_rows, self.config.batch_size, prefix,
                                    prefix + self.prompter.layout.length // 2) if self.config.batch_size > 1 else (0.0, 0.0)
            table = CostTable(table.ms, key_ms=keys, key_slope=slope, prefix=prefix)
            if self.bundle.drafter is not None:
                draft = measure_draft_cost(self.bundle.drafter, self.bundle.target.head, self.sampling.cfg_scale,
                                           self.cfg_rows, sizes, slots=self.config.batch_size, repeats=3,
                                           vocab_size=self.bundle.target.vocab.vocab_size)
                k0 = self.config.adaptive.k0
                table = replace(table, draft_level_ms=CostTable({}, 0.0, draft).draft_cost(k0), draft=draft)
            per_model[key] = table
        if not self.config.needs_drafter:  # jacobi: a draft level runs no model (its planner measures its cost)
            return replace(per_model[key], draft_level_ms=0.0, draft={})
        return per_model[key]

    def use_costs(self, table: CostTable) -> None:
        """Decide budgets from this table instead of measuring (a resumed job reuses its own)."""
        self._costs = table

    def relaxation(self) -> Relaxation | None:
        """LANTERN's relaxed acceptance when configured (lossy), built once per Generator."""
        if self.config.lantern is None:
            return None
        if self._relax is None:  # the bundle's neighbour table (the family's own, else from its codebook)
            lc = self.config.lantern
            self._relax = Relaxation(self.bundle.neighbour_table(lc.k).to(self.device), delta=lc.delta, lam=lc.lam)
        return self._relax
