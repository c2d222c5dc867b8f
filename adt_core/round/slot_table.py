"""A BatchDecoder's slots: which hold an image, admitting images by prefill, retiring them, and
narrowing a batch's tail to fewer slots. `SlotTable` is the slot half of `BatchDecoder`
(adt_core/round/decoder.py), which holds the state these methods read (slots, caches, drafter,
grid, log, planner, meta) and runs the rounds."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from adt_core.families.contract import PromptRows, reads_caption_pairs
from adt_core.results import StepStats
from adt_core.round.noise import seed_keys
from adt_core.round.prefill import prefill_rows
from adt_core.round.sampling import cfg_mix

NARROW = 0.75  # a batch's tail moves to fewer slots once at most this share of its slots are busy
HOLD = 0.01  # idle batch a split wave may spend waiting to refill together, as a share of an image's rounds


@dataclass
class Finished:
    index: int
    prompt: str
    seed: int
    tokens: torch.Tensor  # (num_image_tokens,) long, CPU
    stats: StepStats


class SlotTable:
    # ---- slots --------------------------------------------------------------------------
    def cache_rows(self, slots: np.ndarray) -> np.ndarray:
        """Slot indices (n,) -> their cache rows (n x cfg rows,): cond rows, then uncond rows."""
        return np.concatenate([slots + i * self.capacity for i in range(self.r)])

    def free(self) -> list[int]:
        return np.flatnonzero(~self.slots.active).tolist()

    def active(self) -> list[int]:
        return np.flatnonzero(self.slots.active).tolist()

    def admits_now(self, waiting: int = 0) -> bool:
        """Whether free slots take new images now (`Generator.rounds` asks before refilling;
        `waiting`: images still to admit). A probe leaves slots a token or two apart; refilled at
        once, the wave stays split (plain steps on the cache's ragged path, prefills in small
        groups). While plain steps are the planner's choice for the full batch (`holds(capacity)`:
        a due probe waits for the refill, `Slots.held`) the free slots wait for the rest of the
        wave, and it refills together, as `ar`'s does, when the wait is short (at most HOLD of an
        image's rounds of idle batch) or costs less than the split it mends (`_merge_pays`)."""
        s = self.slots
        a = int(s.active.sum())
        if a == 0 or a == self.capacity:
            return True
        if not self.planner.holds(self.capacity):  # the batch the wave refills to (at 15 of 16 the
            return True  # stand-in's guard read bucket 8-15, where drafting wins: the waves never merged)
        lefts = self.n - s.host_count[s.active]  # (a,) rounds each busy slot still needs
        left = int(lefts.max())
        if (1 - a / self.capacity) * left <= HOLD * self.n:
            return False
        return not self._merge_pays(lefts, waiting)

    def _merge_pays(self, lefts: np.ndarray, waiting: int) -> bool:
        """Whether waiting for the busy slots (`lefts`: rounds each still needs) costs less than
        the split wave would over the `waiting` images behind it. Split by g = max(lefts) tokens,
        a wave of n plain steps reads, past a lockstep batch's, cache rows x (longest - mean) keys
        per step: for g steps the busy slots run n - g ahead of the refilled ones, then, refilled
        in turn, g behind them for n - g steps; g (n - g) keys per cache row and wave in all, for
        as many waves as `waiting` fills (waiting / C): waiting x key_ms x cfg rows x g (n - g)
        ms. Waiting idles every free slot until the last busy one finishes, and each busy one from
        its end on: (free x g + sum(g - lefts)) / C steps of the batch. On a device whose keys
        cost nothing (key_ms 0) waves never wait past HOLD; on this CPU a few waves behind a
        small split pay for it (jacobi at emoji16 B 16, the defaults: a split wave read 27
        admissions against `ar`'s 4 and ran 0.951x, a whole one 0.986x)."""
        costs = self.s.costs
        if costs is None or waiting <= 0:
            return False
        c, g = self.capacity, int(lefts.max())
        idle = ((c - len(lefts)) * g + float((g - lefts).sum())) / c * costs.cost(c)
        spread = waiting * costs.key_ms * self.r * g * max(self.n - g, 0)
        return idle < spread

    def ragged_keys(self) -> tuple[float, float, float, int]:
        """(keys, full, lock, rows): cached keys the next forward reads in all beyond what a
        lockstep batch would, as many for rows spread evenly over an image, the keys a lockstep
        batch's forward reads, and the cache rows. Attention runs every cache row up to the longest
        row's length; `ar`'s rows (admitted together, one token each per step) sit at the longest
        prompt plus the images' common count. lock = cache rows x (longest active prompt + the
        active rows' mean image entries); keys = cache rows x the longest row's length - lock; full
        = cache rows x (C - 1) / (C + 1) x half an image's entries (C slots spread evenly: the
        longest less the mean; 0 for one slot, whose rows grow together)."""
        c, rows, act = self.capacity, self.cache.rows, self.slots.active
        full = rows * (c - 1) / (c + 1) * (self.layout.offset(self.n - 1) + 1) / 2.0
        k = np.count_nonzero(act)
        if not k:
            return 0.0, full, 0.0, rows
        base = self.row_base.reshape(self.r, c)  # (cfg rows, C): a slot's rows hold the same image entries
        lock = int(base[:, act].max()) + float((self.cache.host[:c] - base[0])[act].sum()) / k
        return rows * max(self.cache.length - lock, 0.0), full, rows * lock, rows

    @torch.inference_mode()
    def admit(self, items: list[tuple[int, str, int]], rows: PromptRows) -> list[Finished]:
        """Prefill `items` (index, prompt, seed) into free slots from their PromptRows (cond rows,
        then uncond rows with CFG); returns those already finished (one-token images)."""
        s, setup, dev = self.slots, self.s, self.s.device
        t0 = setup.timer.now()
        n = len(items)
        if rows.images != n or rows.rows != self.r * n:
            raise ValueError(f"{rows.rows} prompt rows for {n} images with {self.r} rows each")
        lengths = rows.lengths.cpu().numpy().astype(np.int64)
        if int(lengths.max()) > self.base:
            raise ValueError(f"a prompt row of {int(lengths.max())} entries; this decoder holds {self.base}")
        free = np.flatnonzero(~s.active)[:n]
        free_t = torch.from_numpy(free).to(dev)
        tmp = setup.bundle.target.new_cache(self.r * n, rows.valid.shape[1])
        logits, hidden = prefill_rows(setup.bundle.target, rows, tmp, lengths)  # (R_n, V), (R_n, L, dim)
        cache_rows = self.cache_rows(free)
        self.row_base[cache_rows] = lengths
        self.base_col = torch.from_numpy(self.row_base[:, None].copy()).to(dev)
        keys = seed_keys(torch.tensor([seed for _, _, seed in items], dtype=torch.long, device=dev))
        gens = [torch.Generator(device=dev).manual_seed(seed) if setup.sampler.kind == "rejection" else None
                for _, _, seed in items]
        first = setup.sampler.sample(cfg_mix(logits, self.scale), keys, torch.zeros_like(keys), gens)  # (n,)
        self.cache.load_rows(torch.from_numpy(cache_rows).to(dev), tmp)
        s.keys[free_t], s.count[free_t] = keys, 0
        s.active[free], s.host_count[free] = True, 0
        for j, b in enumerate(free):
            self.meta[b], s.gens[b] = items[j], gens[j]
        mask = np.zeros(self.capacity, bool)
        mask[free] = True
        if self.grid is not None:
            self.grid.reset(mask)
        if self.jacobi and self.drafter is not None:
            self.drafter.reset(mask)
        elif self.drafter is not None:
            self._drafter_admit(free, free_t, hidden, first, lengths, rows)
        one = np.zeros(self.capacity, np.int64)
        one[free] = 1
        new = torch.zeros(self.capacity, 1, dtype=torch.long, device=dev)
        new[free_t, 0] = first
        s.write(new, torch.from_numpy(one).to(dev), one)
        self.log.admit(free, (setup.timer.now() - t0) / n)
        return self._retire()

    def _drafter_admit(self, free: np.ndarray, free_t: torch.Tensor, hidden: torch.Tensor, first: torch.Tensor,
                       lengths: np.ndarray, rows: PromptRows) -> None:
        """New images' first pair (h at each row's last prompt position, token 0) into the
        drafter's ring; LANTERN-style drafters also read the caption pairs now."""
        mask = np.zeros(self.capacity, bool)
        mask[free] = True
        self.drafter.reset(mask)
        n, dev = len(free), self.s.device
        h = hidden.view(self.r, n, *hidden.shape[1:])  # (cfg, n, T, dim)
        if reads_caption_pairs(self.s.bundle.drafter):
            self.drafter.caption_pairs(free, h)
        elif rows.tokens is not None:  # a token family's drafter reads the prompt's pairs, as EAGLE's does
            self.drafter.prompt_pairs(free, rows.tokens.to(dev), hidden, rows.positions.to(dev), lengths)
        last = torch.zeros(self.r * self.capacity, 1, h.shape[-1], device=dev, dtype=h.dtype)
        tok = torch.zeros(self.capacity, 1, dtype=torch.long, device=dev)
        rows = torch.from_numpy(self.cache_rows(free)).to(dev)
        at = torch.from_numpy(lengths - 1).to(dev)  # (R_n,) each row's last prompt entry
        last[rows, 0] = hidden[torch.arange(self.r * n, device=dev), at]
        tok[free_t, 0] = first
        counts = torch.zeros(self.capacity, dtype=torch.long, device=dev)
        counts[free_t] = 1
        self.drafter.ring.push(torch.zeros_like(counts), last, tok, counts)

    def _retire(self) -> list[Finished]:
        s = self.slots
        done = np.flatnonzero(s.active & (s.host_count >= self.n))
        if done.size == 0:
            return []
        grid = torch.zeros(done.size, self.layout.num_codes, dtype=torch.long)
        grid[:, : self.n] = s.tokens[torch.from_numpy(done).to(s.tokens.device), : self.n].cpu()
        out = []
        for j, b in enumerate(done):
            index, prompt, seed = self.meta[b]
            out.append(Finished(index, prompt, seed, grid[j], self.log.finish(b, self.batch_size)))
            self.meta[b], s.gens[b] = None, None
        mask = np.zeros(self.capacity, bool)
        mask[done] = True
        s.active[mask], s.host_count[mask] = False, 0
        s.count[torch.from_numpy(mask).to(s.count.device)] = 0
        host = self.cache.host.copy()
        host[self.host_rows(mask)] = 0
        self.cache.set_lengths(host)
        if self.drafter is not None:
            self.drafter.reset(mask)
        return out

    def narrow(self) -> bool:
        """The batch's tail (no image will be admitted again): once at most NARROW of the slots
        hold an image, those move to slots 0 .. a - 1 and every later round computes those a
        slots, not C: images that speculation left behind cost what a in flight cost, not a full
        batch of padding (a fixed-length `ar` wave finishes together and never narrows). Outputs
        are unchanged: a slot's draws depend on its seed and positions only. True when it narrowed."""
        s = self.slots
        order = np.flatnonzero(s.active)  # (n,) the busy slots, in order
        n = len(order)
        if n == 0 or n > NARROW * self.capacity:
            return False
        rows = self.cache_rows(order)  # (n x cfg rows,)
        self.cache.narrow(rows)
        for part in (s, self.grid, self.drafter, self.log):
            if part is not None:
                part.narrow(order)
        self.row_base = self.row_base[rows]
        self.base_col = torch.from_numpy(self.row_base[:, None].copy()).to(self.s.device)
        self.meta = [self.meta[i] for i in order]
        self.planner.narrow(n)
        self.capacity = n
        return True
