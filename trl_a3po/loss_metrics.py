"""The decoupled loss's metrics: kept on the device while a micro-batch trains, read once per optimizer step, summed
over processes in one reduction (names and denominators as GRPOTrainer logs them where it has them)."""

from __future__ import annotations

import functools

import torch
from trl.trainer.utils import nanmax, nanmin

from .proximal import CLIPPED_LOSS_TYPES, PROX_APPROXIMATIONS, approximate_prox_logp, staleness_alpha
from .timing import ProxTimer


class LossMetrics:
    """Writes into GRPOTrainer's `_metrics` (mode -> name -> values), which TRL averages and logs."""

    def __init__(
        self,
        accelerator,
        metrics: dict,
        prox_timer: ProxTimer,
        *,
        loss_type: str,
        max_staleness: int,
        prox_logp_method: str,
    ):
        self.accelerator = accelerator
        self.metrics = metrics
        self.prox_timer = prox_timer  # read once per optimizer step
        self.loss_type = loss_type
        self.max_staleness = max_staleness
        self.prox_logp_method = prox_logp_method
        self._deferred: list[tuple[str, str, torch.Tensor]] = []

    def defer(self, mode: str, key: str, value: torch.Tensor) -> None:
        """Keep a metric on the device; `flush` reads them all at once. Reading each with `.item()` would
        synchronise the device several times per micro-batch (the hot path the proximal approximation frees)."""
        self._deferred.append((mode, key, value.detach().float().reshape(())))

    def flush(self) -> None:
        """One device-to-host copy for every metric deferred since the last flush (once per optimizer step)."""
        if not self._deferred:
            return
        values = torch.stack([value for _, _, value in self._deferred]).tolist()
        for (mode, key, _), value in zip(self._deferred, values):
            self.metrics[mode][key].append(value)
        self._deferred = []

    def global_masked_mean(self, values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        mask = mask.to(values.dtype)
        totals = self.accelerator.reduce(torch.stack([(values * mask).sum(), mask.sum()]), reduction="sum")
        return totals[0] / totals[1].clamp(min=1.0)

    def log_loss(self, mode, stats, staleness, mask, entropies, logp, behav_logp, prox_logp):
        defer = functools.partial(self.defer, mode)
        reduce = self.accelerator.reduce
        in_mask = mask.bool()
        total, tokens_at = self._summed_counts(stats, staleness, in_mask)
        tokens, seqs = total["num_tokens"].clamp(min=1.0), total["num_seqs"].clamp(min=1.0)
        units = total["ratio_units"].clamp(min=1.0)
        extremes = self.accelerator.gather(
            torch.stack([stats["behav_imp_weight_min"], stats["ratio_min"]]).unsqueeze(0)
        )
        maxima = self.accelerator.gather(torch.stack([stats["behav_imp_weight_max"], stats["ratio_max"]]).unsqueeze(0))
        staleness_max = self.accelerator.gather(staleness.masked_fill(~in_mask, 0).max().reshape(1)).max()

        defer("a3po/staleness/mean", total["staleness_sum"] / tokens)
        defer("a3po/staleness/max", staleness_max)
        if mode == "train":
            # Histogram inputs: the share of trained tokens at each staleness 0..max_staleness.
            for d, share in enumerate(tokens_at / tokens):
                defer(f"a3po/staleness/frac_d{d}", share)
            defer("a3po/gen/mixed_version_frac", total["mixed"] / seqs)
        defer("a3po/alpha/mean", total["alpha_sum"] / tokens)
        defer(
            "a3po/behav_imp_weight/mean",
            total["behav_imp_weight_sum"] / total["behav_imp_weight_count"].clamp(min=1.0),
        )
        defer("a3po/behav_imp_weight/min", nanmin(extremes[:, 0]))
        defer("a3po/behav_imp_weight/max", nanmax(maxima[:, 0]))
        # Shares of tokens and of sequences whose behaviour weight was outside the bounds (masked or truncated, as
        # behav_imp_weight_mode says; at sequence level a sequence's tokens share its fate).
        defer("a3po/capped_frac", total["capped_sum"] / tokens)
        defer("a3po/below_min_frac", total["below_min_sum"] / tokens)
        defer("a3po/seq_capped_frac", total["seq_capped_sum"] / seqs)
        defer("a3po/seq_below_min_frac", total["seq_below_min_sum"] / seqs)
        defer("a3po/ratio/min", nanmin(extremes[:, 1]))
        defer("a3po/ratio/max", nanmax(maxima[:, 1]))
        defer("a3po/dual_clip_frac", total["dual_clip_sum"] / tokens)
        # GRPOTrainer's names and denominators (tokens, or sequences at sequence level), so TRL dashboards and the
        # paper's "clipped tokens" figure read them unchanged.
        if self.loss_type in CLIPPED_LOSS_TYPES:
            defer("clip_ratio/low_mean", total["clip_low_sum"] / units)
            defer("clip_ratio/high_mean", total["clip_high_sum"] / units)
            defer("clip_ratio/region_mean", (total["clip_low_sum"] + total["clip_high_sum"]) / units)
        elif self.loss_type == "cispo":
            defer("cispo_clip_ratio", total["clip_high_sum"] / units)
        elif self.loss_type == "vespo":
            defer("vespo/phi_seq_mean", total["vespo_phi_sum"] / total["num_rows"].clamp(min=1.0))
        defer("entropy", self.global_masked_mean(entropies.detach(), mask))

        if mode == "train" and self.prox_logp_method == "metrics":
            self.prox_approximation_errors(self.metrics[mode], staleness, mask, logp, behav_logp, prox_logp)
        if mode == "train" and self.accelerator.sync_gradients:
            # One value per optimizer step, averaged over processes; then every deferred metric is read at once.
            seconds = torch.tensor(self.prox_timer.pop_seconds(), device=self.accelerator.device)
            defer("a3po/prox_time_s", reduce(seconds, reduction="mean"))
        if mode != "train" or self.accelerator.sync_gradients:
            self.flush()

    def _summed_counts(self, stats, staleness, in_mask):
        """The loss's counts and the staleness counts, summed over processes in one reduction, keyed by name; and the
        number of trained tokens at each staleness 0..max_staleness (the histogram has fixed keys: the most a
        trained token can have). Staleness is per token: shares, mean and alpha are over the tokens trained."""
        eta = self.max_staleness
        tokens_at = torch.bincount(staleness[in_mask].clamp(min=0, max=eta), minlength=eta + 1).float()
        alpha = staleness_alpha(staleness)
        # Sequences whose tokens come from more than one version (in-flight weight updates).
        newest = staleness.masked_fill(~in_mask, torch.iinfo(staleness.dtype).max).min(-1).values
        oldest = staleness.masked_fill(~in_mask, -1).max(-1).values
        mixed = ((newest != oldest) & in_mask.any(-1)).sum().float()
        counts = {key: value for key, value in stats.items() if not key.endswith(("_min", "_max"))}
        counts.update(
            staleness_sum=(staleness * in_mask).sum().float(), alpha_sum=(alpha * in_mask).sum(), mixed=mixed
        )
        names = sorted(counts)
        reduced = self.accelerator.reduce(
            torch.cat([torch.stack([counts[name] for name in names]), tokens_at]), reduction="sum"
        )
        return dict(zip(names, reduced[: len(names)])), reduced[len(names) :]

    def prox_approximation_errors(self, metrics, staleness, mask, logp, behav_logp, prox_logp):
        """Error of each approximation against the recomputed proximal log-probs, over tokens, overall and per token
        staleness (`metrics` mode only: a diagnostic, read at once)."""
        mask = mask.to(prox_logp.dtype)
        if staleness.dim() == 1:  # one staleness per sample
            staleness = staleness.unsqueeze(-1).expand_as(prox_logp)
        # The same buckets on every process, so each reduces the same tensor.
        buckets = int(self.accelerator.gather(staleness.masked_fill(mask == 0, 0).max().reshape(1)).max()) + 1
        for method in PROX_APPROXIMATIONS:
            approx = approximate_prox_logp(method, behav_logp, logp, staleness)
            abs_err = (approx - prox_logp).abs() * mask
            rel_err = abs_err / prox_logp.abs().clamp(min=1e-8)
            # (abs, rel, tokens) summed per staleness bucket on this process, then over processes.
            per_bucket = torch.zeros(buckets, 3, dtype=torch.float64, device=mask.device)
            per_bucket.index_add_(
                0,
                staleness.clamp(max=buckets - 1).flatten(),
                torch.stack([abs_err.flatten(), rel_err.flatten(), mask.flatten()], dim=-1).double(),
            )
            per_bucket = self.accelerator.reduce(per_bucket, reduction="sum")
            total = per_bucket.sum(0)
            count = total[2].clamp(min=1.0)
            metrics[f"a3po/prox_error/{method}/abs"].append((total[0] / count).item())
            metrics[f"a3po/prox_error/{method}/rel"].append((total[1] / count).item())
            for d in range(buckets):
                if per_bucket[d, 2] > 0:
                    metrics[f"a3po/prox_error/{method}/abs/d{d}"].append((per_bucket[d, 0] / per_bucket[d, 2]).item())
