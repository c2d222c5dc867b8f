"""Generator: the one orchestrator of decoding (vanilla AR and speculative trees), batched.

Sequence layout per image: T caption positions, then image tokens; image token i sits at
sequence position T + i. The target's output at position T + i - 1 predicts token i (the
last caption position predicts token 0). With CFG every image has two rows, cond then uncond
(for a batch: all cond rows, then all uncond rows), sharing one caption mask.

A round: the ROOT of each image is its last committed token (not yet in the target's cache).
Draft a tree below it, run the target once on every image's root + tree under tree masks,
verify, keep the root and the accepted path in the cache, commit accepted tokens + the bonus
token. Up to `DecodeConfig.batch_size` images are in flight (adt_core/batch.py); a prompt
enters as soon as a slot frees (continuous refill). Vanilla AR is the same loop with
root-only trees. With the coupled sampler (or greedy) every image's tokens are a function of
its prompt, seed and config only: not of the method, the batch or the order of prompts.
"""

from __future__ import annotations

import weakref
from collections import deque
from typing import Iterator

import numpy as np
import torch

from adt_core.calibrate import CostTable, Timer, batch_sizes, measure_draft_cost, measure_target_cost
from adt_core.config import DecodeConfig, SamplingConfig
from adt_core.draft import DraftScorer
from adt_core.kv_cache import KVCache
from adt_core.models.bundle import Bundle
from adt_core.noise import gumbel
from adt_core.results import GenerationResult, PromptFailure, RoundTrace, StepStats, estimate_speedup
from adt_core.sampling import cfg_mix, perturbed, target_probs
from adt_core.tree import DraftTree
from adt_core.lantern import relaxation_for
from adt_core.verify import Relaxation, VerifyResult, verify_coupled, verify_greedy, verify_stochastic

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
        tc = bundle.target.config
        enc = bundle.text_encoder
        if (enc.max_tokens, enc.dim) != (tc.cls_token_num, tc.caption_dim):
            raise ValueError(
                f"text encoder gives {enc.max_tokens} x {enc.dim} caption states, "
                f"target expects {tc.cls_token_num} x {tc.caption_dim}"
            )
        if config.method != "ar" and bundle.drafter is None:
            raise ValueError(f"method {config.method!r} needs a drafter; bundle {bundle.name!r} has none")
        self.num_tokens = tc.num_image_tokens if config.max_tokens is None else min(config.max_tokens, tc.num_image_tokens)
        self.timer = Timer(self.device)
        self._relax: Relaxation | None = None
        self._costs: CostTable | None = None
        # what draws the tokens: the argmax (greedy), fixed Gumbel noise (coupled) or generators (rejection)
        self.sampler = "greedy" if self.sampling.greedy else config.sampler
        coupled = self.sampling if self.sampler == "coupled" else None
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

    @torch.inference_mode()
    def stream(self, prompts: list[str], seeds: list[int]) -> Iterator[tuple[int, GenerationResult | PromptFailure]]:
        """Yield (input index, result) as images finish, up to `batch_size` in flight; a free
        slot takes the next prompt at once. A prompt whose caption cannot be encoded yields a
        PromptFailure and the others go on."""
        from adt_core.batch import BatchDecoder

        if len(prompts) != len(seeds):
            raise ValueError(f"{len(prompts)} prompts but {len(seeds)} seeds")
        if not prompts:
            return
        self._place_models()
        dec = BatchDecoder(self, min(self.config.batch_size, len(prompts)))
        queue = deque((i, p, int(s)) for i, (p, s) in enumerate(zip(prompts, seeds)))
        while queue or dec.active():
            free = len(dec.free())
            if queue and free:
                items = [queue.popleft() for _ in range(min(free, len(queue)))]
                items, captions, cmask, failed = self._encode(items)
                yield from failed
                if items:
                    yield from self._finish(dec.admit(items, captions, cmask))
                continue
            yield from self._finish(dec.step())

    # ---- shared steps -------------------------------------------------------------------
    def _encode(self, items):
        """Caption states for (index, prompt, seed) items; a prompt that fails alone is dropped
        and yielded as a failure."""
        enc = self.bundle.text_encoder
        try:
            captions, cmask = enc.encode([p for _, p, _ in items])
            return items, captions.to(self.device), cmask.to(self.device), []
        except Exception:  # noqa: BLE001 - find the prompt(s) that fail, keep the others
            ok, caps, masks, failed = [], [], [], []
            for it in items:
                try:
                    c, m = enc.encode([it[1]])
                    ok.append(it), caps.append(c), masks.append(m)
                except Exception as err:  # noqa: BLE001
                    failed.append((it[0], PromptFailure(it[1], it[2], err)))
            if not ok:
                return [], None, None, failed
            return ok, torch.cat(caps).to(self.device), torch.cat(masks).to(self.device), failed

    def _finish(self, done) -> Iterator[tuple[int, GenerationResult]]:
        """VQ-decode finished images together and hand them out."""
        if not done:
            return
        h, w = self.bundle.grid
        grid = torch.stack([d.tokens for d in done]).view(-1, h, w)
        images = self.bundle.vq.decode(grid.to(self.device)).cpu().numpy()  # (n, H*f, W*f, 3) uint8
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

    def _rows(self, captions: torch.Tensor, cmask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, T, C) captions -> model rows (cond then uncond), with the caption mask per row."""
        if self.cfg_rows == 1:
            return captions, cmask
        uncond = self.bundle.target.cls_embedding.uncond_embedding.to(captions.dtype)  # (T, C)
        return torch.cat([captions, uncond.expand_as(captions)]), torch.cat([cmask, cmask])

    def prefill(self, captions: torch.Tensor, cmask: torch.Tensor, cache: KVCache) -> tuple[torch.Tensor, torch.Tensor]:
        """Run the caption rows; returns logits (R, V) at the last position and hidden (R, T, dim)."""
        rows, rmask = self._rows(captions, cmask)
        t = rows.shape[1]
        cache.valid[:, :t] = rmask
        causal = torch.ones(t, t, dtype=torch.bool, device=self.device).tril()
        positions = torch.arange(t, device=self.device)
        logits, hidden = self.bundle.target(positions, cache.attn_mask(causal), cache, captions=rows)
        return logits[:, -1], hidden

    def noise(self, seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor | None:
        """Coupled Gumbel rows: seeds (B,), image positions (B, P) -> (B, P, V); None unless coupled."""
        if self.sampler != "coupled":
            return None
        return gumbel(seeds, positions, self.bundle.target.config.vocab_size)

    def noise_rows(self, seed: torch.Tensor, index: int, count: int) -> torch.Tensor | None:
        """(count, V) Gumbel rows of image positions index .. index + count - 1 for one seed (1,)."""
        rows = self.noise(seed, torch.arange(index, index + count, device=self.device)[None])
        return None if rows is None else rows[0]

    def sample(self, mixed: torch.Tensor, gens: list[torch.Generator], seeds: torch.Tensor,
               positions: list[int]) -> torch.Tensor:
        """mixed (B, V) -> (B,) tokens at image positions (B,): the argmax when greedy, the
        perturbed argmax when coupled, else one multinomial draw per image generator."""
        if self.sampler == "rejection":
            probs = target_probs(mixed, self.sampling)
            return torch.cat([torch.multinomial(probs[i], 1, generator=g) for i, g in enumerate(gens)])
        pos = torch.tensor(positions, dtype=torch.long, device=self.device)[:, None]
        noise = self.noise(seeds, pos)
        return perturbed(mixed, self.sampling, None if noise is None else noise[:, 0]).argmax(-1)

    # ---- speculative pieces ---------------------------------------------------------------
    def max_tree_nodes(self) -> int:
        c = self.config
        if c.method == "ar":
            return 0
        if c.method == "static":
            return len(c.tree.static_paths)
        if c.method == "adt":
            return c.adaptive.n_max
        return c.tree.budget

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
            table = measure_target_cost(self.bundle.target, rows=self.cfg_rows, sizes=sizes, repeats=3, warmup=1,
                                        slots=self.config.batch_size)
            if self.bundle.drafter is not None:
                draft = measure_draft_cost(self.bundle.drafter, self.bundle.target.head, self.sampling.cfg_scale,
                                           self.cfg_rows, sizes, slots=self.config.batch_size, repeats=3)
                k0 = self.config.adaptive.k0
                table = CostTable(table.ms, CostTable({}, 0.0, draft).draft_cost(k0), draft)
            per_model[key] = table
        return per_model[key]

    def use_costs(self, table: CostTable) -> None:
        """Decide budgets from this table instead of measuring (a resumed job reuses its own)."""
        self._costs = table

    def verify_all(self, trees: dict, mixed: torch.Tensor, slots: dict) -> dict[int, VerifyResult]:
        """Verify every slot's tree: mixed (cap, S, V) target logits at the padded nodes.
        Root-only trees are one vectorised draw (a plain AR step)."""
        roots = [b for b, t in trees.items() if t.size == 1]
        out: dict[int, VerifyResult] = {}
        if roots:
            sl = [slots[b] for b in roots]
            idx = torch.tensor(roots, device=self.device)
            seeds = torch.cat([s.seed_t for s in sl])
            toks = self.sample(mixed[idx, 0], [s.gen for s in sl], seeds, [len(s.committed) for s in sl]).tolist()
            out.update({b: VerifyResult([], int(t)) for b, t in zip(roots, toks)})
        for b, tree in trees.items():
            if tree.size > 1:
                s = slots[b]
                noise = self.noise_rows(s.seed_t, len(s.committed), tree.depth + 1)
                out[b] = self._verify(tree, mixed[b, : tree.size], s.gen, noise)
        return out

    def _verify(self, tree: DraftTree, mixed: torch.Tensor, gen: torch.Generator,
                noise: torch.Tensor | None) -> VerifyResult:
        """mixed (n+1, V) target logits at the tree's nodes; noise (levels + 1, V) rows by depth."""
        relax = self.relaxation()
        if self.sampler == "greedy":
            return verify_greedy(tree, mixed, relax)
        if self.sampler == "coupled":
            return verify_coupled(tree, mixed, noise[tree.depths.to(noise.device)], self.sampling, relax)
        return verify_stochastic(tree, mixed, self.sampling, gen, relax)

    def relaxation(self) -> Relaxation | None:
        """LANTERN's relaxed acceptance when configured (lossy), built once per Generator."""
        if self.config.lantern is None:
            return None
        if self._relax is None:
            codebook = self.bundle.vq.quantize.embedding.weight
            self._relax = relaxation_for(codebook, self.config.lantern, self.device)
        return self._relax

    def record(self, stats: StepStats, tree: DraftTree | None, res: VerifyResult | None, index: int, width: int,
               draft_ms: float, verify_ms: float, slots: int, tokens: int, drafted: bool) -> None:
        """Add one round to an image's stats (times are its shares of the round)."""
        stats.target_forwards += 1
        stats.total_ms += draft_ms + verify_ms
        stats.draft_ms += draft_ms
        stats.verify_ms += verify_ms
        if self.config.method == "ar":
            return
        if tree is None:  # a plain AR step of a speculative method (nothing drafted)
            stats.accepted_lengths.append(0)
            stats.rounds.append(RoundTrace(index, 0, 0, 0, 0, draft_ms, verify_ms, slots, tokens))
            return
        nodes = tree.size - 1
        if drafted:
            stats.draft_forwards += max(1, tree.depth)
        stats.draft_tokens += nodes
        stats.accepted_draft_tokens += res.num_accepted
        stats.accepted_lengths.append(res.num_accepted)
        stats.rounds.append(RoundTrace(index, tree.depth, width, nodes, res.num_accepted, draft_ms, verify_ms,
                                       slots, tokens))
