"""Generator: the one orchestrator of decoding (vanilla AR and speculative trees).

Sequence layout per image: T caption positions, then image tokens; image token i sits at
sequence position T + i. The target's output at position T + i - 1 predicts token i (the
last caption position predicts token 0). With CFG every image has two rows, cond then uncond
(for a batch: all cond rows, then all uncond rows), sharing one caption mask.

A speculative round: the ROOT is the last committed token (not yet in the target's cache).
Draft a tree below it, run the target once on root + tree under the tree mask, verify,
keep the root and the accepted path in the cache, commit accepted tokens + the bonus token.
"""

from __future__ import annotations

import dataclasses
import weakref
from dataclasses import dataclass, field

import numpy as np
import torch

from adt_core.adaptive import AdaptiveController, cost_budget
from adt_core.calibrate import CostTable, Timer, measure_draft_level, measure_target_cost
from adt_core.config import DecodeConfig, SamplingConfig
from adt_core.draft import DraftScorer, TreeProposer
from adt_core.kv_cache import KVCache
from adt_core.models.bundle import Bundle
from adt_core.noise import gumbel
from adt_core.sampling import cfg_mix, perturbed, target_probs
from adt_core.tree import DraftTree
from adt_core.lantern import relaxation_for
from adt_core.verify import Relaxation, VerifyResult, verify_coupled, verify_greedy, verify_stochastic

# measured target costs: model -> {(device, dtype, rows): table}; entries die with the model
_COSTS: "weakref.WeakKeyDictionary[torch.nn.Module, dict[tuple, CostTable]]" = weakref.WeakKeyDictionary()
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class RoundTrace:
    position: int  # raster index of the first drafted token (root index + 1)
    depth: int  # draft levels of the tree actually built
    width: int  # top-k per expansion (0 for static trees / root-only rounds)
    nodes: int  # drafted nodes verified (root excluded)
    accepted: int  # accepted drafted tokens (bonus excluded)
    draft_ms: float
    verify_ms: float


@dataclass
class StepStats:
    target_forwards: int = 0  # prefill included
    draft_forwards: int = 0
    draft_tokens: int = 0  # drafted nodes sent to verification
    accepted_draft_tokens: int = 0
    accepted_lengths: list[int] = field(default_factory=list)  # per round: accepted drafted tokens
    draft_ms: float = 0.0
    verify_ms: float = 0.0
    total_ms: float = 0.0
    batch_size: int = 1  # images decoded together (AR batches share one wall time)
    rounds: list[RoundTrace] = field(default_factory=list)
    lossy: bool = False  # True when a relaxed (LANTERN) acceptance was used
    sampler: str = "greedy"  # "greedy" (temperature 0), "coupled" or "rejection": what drew the tokens
    estimated_speedup: float | None = None

    @property
    def num_spec_steps(self) -> int:
        return len(self.accepted_lengths)

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens committed per speculative step: 1 + accepted / steps (vLLM's definition)."""
        steps = self.num_spec_steps
        return 1.0 + self.accepted_draft_tokens / steps if steps else 1.0

    @property
    def draft_acceptance_rate(self) -> float:
        return self.accepted_draft_tokens / self.draft_tokens if self.draft_tokens else 0.0


@dataclass
class GenerationResult:
    prompt: str
    seed: int
    tokens: torch.Tensor  # (H, W) long, CPU
    image: np.ndarray  # (H*f, W*f, 3) uint8
    stats: StepStats


def estimate_speedup(stats: StepStats, costs: CostTable, num_tokens: int) -> float:
    """Vanilla AR's modelled time over this image's: AR pays num_tokens one-token forwards; the
    speculative run paid one prefill-sized step plus, per round, a forward of root + nodes and
    its measured draft time. Uses the calibrated target costs, not this run's wall time."""
    ar = num_tokens * costs.cost(1)
    spec = costs.cost(1) + sum(costs.cost(r.nodes + 1) + r.draft_ms for r in stats.rounds)
    return ar / spec if spec > 0 else 1.0


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
        # what draws the tokens: the argmax (greedy), fixed Gumbel noise (coupled) or generators (rejection)
        self.sampler = "greedy" if self.sampling.greedy else config.sampler
        coupled = self.sampling if self.sampler == "coupled" else None
        self.scorer = DraftScorer(coupled, perturbed=config.draft_score == "perturbed")

    # ---- public -------------------------------------------------------------------------
    @torch.inference_mode()
    def generate(self, prompts: list[str], seeds: list[int]) -> list[GenerationResult]:
        if len(prompts) != len(seeds):
            raise ValueError(f"{len(prompts)} prompts but {len(seeds)} seeds")
        self._place_models()
        captions, cmask = self.bundle.text_encoder.encode(list(prompts))  # (B, T, C), (B, T)
        captions, cmask = captions.to(self.device), cmask.to(self.device)
        seed_t = torch.tensor([int(s) for s in seeds], dtype=torch.long, device=self.device)  # (B,)
        gens = [torch.Generator(device=self.device).manual_seed(int(s)) for s in seeds]
        if self.config.method == "ar":
            tokens, stats = self._decode_ar(captions, cmask, gens, seed_t)
        else:
            outs = [self._decode_speculative(captions[i : i + 1], cmask[i : i + 1], gens[i], seed_t[i : i + 1])
                    for i in range(len(prompts))]
            tokens = torch.stack([t for t, _ in outs])
            stats = [s for _, s in outs]
            costs = self.cost_table()
            for st in stats:
                st.estimated_speedup = estimate_speedup(st, costs, self.num_tokens)
        h, w = self.bundle.grid
        grid = tokens.view(-1, h, w)
        images = self.bundle.vq.decode(grid).cpu().numpy()  # (B, H*f, W*f, 3) uint8
        return [
            GenerationResult(p, int(s), grid[i].cpu(), images[i], stats[i])
            for i, (p, s) in enumerate(zip(prompts, seeds))
        ]

    # ---- shared steps -------------------------------------------------------------------
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

    def _prefill(self, captions: torch.Tensor, cmask: torch.Tensor, cache: KVCache) -> tuple[torch.Tensor, torch.Tensor]:
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

    def _sample(self, mixed: torch.Tensor, gens: list[torch.Generator], seeds: torch.Tensor, index: int) -> torch.Tensor:
        """mixed (B, V) -> (B,) tokens for image position `index`: the argmax when greedy, the
        perturbed argmax when coupled, else one multinomial draw per image generator."""
        if self.sampler == "rejection":
            probs = target_probs(mixed, self.sampling)
            return torch.cat([torch.multinomial(probs[i], 1, generator=g) for i, g in enumerate(gens)])
        pos = torch.full((seeds.numel(), 1), index, dtype=torch.long, device=self.device)
        noise = self.noise(seeds, pos)
        return perturbed(mixed, self.sampling, None if noise is None else noise[:, 0]).argmax(-1)

    # ---- vanilla autoregressive ---------------------------------------------------------
    def _decode_ar(self, captions, cmask, gens, seeds) -> tuple[torch.Tensor, list[StepStats]]:
        b, t = captions.shape[:2]
        n, target = self.num_tokens, self.bundle.target
        t0 = self.timer.now()
        cache = target.new_cache(b * self.cfg_rows, t + n)
        logits, _ = self._prefill(captions, cmask, cache)
        tokens = torch.zeros(b, target.config.num_image_tokens, dtype=torch.long, device=self.device)
        tokens[:, 0] = self._sample(cfg_mix(logits, self.sampling.cfg_scale), gens, seeds, 0)
        one = torch.ones(1, 1, dtype=torch.bool, device=self.device)
        for i in range(1, n):
            inp = tokens[:, i - 1 : i].repeat(self.cfg_rows, 1)  # (R, 1)
            pos = torch.tensor([t + i - 1], device=self.device)
            logits, _ = target(pos, cache.attn_mask(one), cache, tokens=inp)
            tokens[:, i] = self._sample(cfg_mix(logits[:, -1], self.sampling.cfg_scale), gens, seeds, i)
        total = self.timer.now() - t0
        stats = [StepStats(target_forwards=n, total_ms=total, verify_ms=total, batch_size=b, estimated_speedup=1.0,
                           sampler=self.sampler) for _ in range(b)]
        return tokens, stats

    # ---- speculative --------------------------------------------------------------------
    def _max_tree_nodes(self) -> int:
        c = self.config
        if c.method == "static":
            return len(c.tree.static_paths)
        if c.method == "adt":
            return c.adaptive.n_max
        return c.tree.budget

    def _propose(self, proposer: TreeProposer, ctrl: AdaptiveController | None, root: int, root_pos: int,
                 index: int, max_depth: int, noise: torch.Tensor | None) -> tuple[DraftTree, int]:
        """Draft this round's tree; returns it and the width (top-k) it was expanded with.

        noise: (levels, V) coupled Gumbel rows of image positions index, index + 1, ... or None."""
        c = self.config
        if c.method == "static":
            tree = proposer.propose_static(root, root_pos, c.tree.static_paths, min(c.tree.depth, max_depth), noise)
            return tree, 0
        min_confidence = 0.0
        if ctrl is None:
            d, k, budget = c.tree.depth, c.tree.top_k, c.tree.budget
        else:
            shape = ctrl.shape(index)
            d, k, budget = shape.depth, shape.width, shape.budget
            if c.adaptive.budget == "cost":
                costs = self.cost_table()
                budget = lambda scores, levels: cost_budget(scores, costs, levels * costs.draft_level_ms, c.adaptive)  # noqa: E731
                # one more level adds at most the summed confidence of the paths it extends in
                # expected tokens, each worth one target step: stop once that is below a level's cost
                min_confidence = costs.draft_level_ms / costs.cost(1)
        return proposer.propose_dynamic(root, root_pos, min(d, max_depth), k, budget, min_confidence, noise), k

    def cost_table(self) -> CostTable:
        """Target forward cost vs new tokens on this device/dtype, measured once and cached."""
        per_model = _COSTS.setdefault(self.bundle.target, {})
        key = (str(self.device), self.config.dtype, self.cfg_rows)
        if key not in per_model:
            self._place_models()
            table = measure_target_cost(self.bundle.target, rows=self.cfg_rows, repeats=3, warmup=1)
            if self.bundle.drafter is not None:
                level = measure_draft_level(self.bundle.drafter, self.bundle.target.head, self.sampling.cfg_scale,
                                            self.cfg_rows, width=self.config.adaptive.k0, repeats=3)
                table = dataclasses.replace(table, draft_level_ms=level)
            per_model[key] = table
        return per_model[key]

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

    def _decode_speculative(self, caption, cmask, gen, seed) -> tuple[torch.Tensor, StepStats]:
        """One image: caption (1, T, C), cmask (1, T), seed (1,) -> tokens (N,) and its stats."""
        b = self.bundle
        t = caption.shape[1]
        n, rows, s = self.num_tokens, self.cfg_rows, self.sampling.cfg_scale
        max_nodes = self._max_tree_nodes()
        depth_cap = self.config.adaptive.d_max if self.config.method == "adt" else self.config.tree.depth
        stats = StepStats(lossy=self.config.lantern is not None, sampler=self.sampler)
        t0 = self.timer.now()
        cache = b.target.new_cache(rows, t + n + max_nodes + 1)
        proposer = TreeProposer(b.drafter, b.target.head, s, rows, t + n + (depth_cap + 1) * (max_nodes + 1),
                                self.scorer)
        logits, hidden = self._prefill(caption, cmask, cache)
        stats.target_forwards += 1
        first = int(self._sample(cfg_mix(logits, s), [gen], seed, 0)[0])
        committed = [first]
        if b.drafter.config.caption_pairs:  # LANTERN: (code 0, h_j) for every caption position first
            proposer.observe(hidden, [0] * (t - 1) + [first], 1)
        else:
            proposer.observe(hidden[:, -1:], [first], t)
        ctrl = AdaptiveController(b.grid, self.config.adaptive) if self.config.method == "adt" else None
        while len(committed) < n:
            index = len(committed)  # image index of the first drafted token
            root_pos = t + index - 1
            max_depth = n - index - 1
            ta = self.timer.now()
            levels = min(depth_cap, max(max_depth, 0))
            noise = self.noise(seed, torch.arange(index, index + levels + 1, device=self.device)[None])
            noise = None if noise is None else noise[0]  # (levels + 1, V)
            if max_depth > 0:
                tree, width = self._propose(proposer, ctrl, committed[-1], root_pos, index, max_depth, noise)
            else:
                tree, width = DraftTree.root_only(committed[-1], root_pos, self.device), 0
            tb = self.timer.now()
            prefix = cache.length
            tree_tokens = tree.tokens.to(self.device)[None].expand(rows, -1)  # (R, n+1)
            logits, hidden = b.target(tree.positions.to(self.device), cache.attn_mask(tree.ancestor_mask()), cache,
                                      tokens=tree_tokens)
            res = self._verify(tree, cfg_mix(logits, s)[0], gen, noise)
            keep = torch.tensor([0] + res.accepted, dtype=torch.long, device=self.device)
            cache.keep(prefix, keep)
            new = tree.tokens[res.accepted].tolist() + [res.bonus]
            committed += new
            if len(committed) < n:
                proposer.observe(hidden[:, keep], new, root_pos + 1)
            if ctrl is not None:
                ctrl.observe(index, tree.depth, width, res.num_accepted)
            tc = self.timer.now()
            self._record(stats, tree, res, index, width, tb - ta, tc - tb)
        stats.draft_forwards = proposer.forwards
        stats.total_ms = self.timer.now() - t0
        tokens = torch.zeros(b.target.config.num_image_tokens, dtype=torch.long, device=self.device)
        tokens[: len(committed)] = torch.tensor(committed, device=self.device)
        return tokens, stats

    def _record(self, stats: StepStats, tree: DraftTree, res: VerifyResult, index: int, width: int,
                draft_ms: float, verify_ms: float) -> None:
        nodes = tree.size - 1
        stats.target_forwards += 1
        stats.draft_tokens += nodes
        stats.accepted_draft_tokens += res.num_accepted
        stats.accepted_lengths.append(res.num_accepted)
        stats.draft_ms += draft_ms
        stats.verify_ms += verify_ms
        stats.rounds.append(RoundTrace(index, tree.depth, width, nodes, res.num_accepted, draft_ms, verify_ms))
