//! Balanced Adaptive Rollout: which rollouts of a group (one task) go into training.
//!
//! Rollouts of a group arrive in strides (first `n`, then `stride` more at a time, up to
//! `n_max`). As soon as `n` of them can be chosen with a positive fraction inside
//! `[min_positive, max_positive]` (3 to 5 positives of 8 by default), those are taken;
//! until then more are asked for. At `n_max` the band is relaxed to the nearest feasible
//! count; a group with no positive or no negative rollout has no learning signal and is
//! dropped.

/// The selection's knobs.
#[derive(Debug, Clone, PartialEq)]
pub struct BarConfig {
    /// Rollouts trained on per group.
    pub n: usize,
    /// Most rollouts generated for a group.
    pub n_max: usize,
    /// Rollouts asked for each time the band cannot be met yet.
    pub stride: usize,
    pub min_positive: f64,
    pub max_positive: f64,
    /// A rollout is positive when its reward is above this.
    pub positive_above: f64,
}

impl Default for BarConfig {
    fn default() -> Self {
        BarConfig {
            n: 8,
            n_max: 16,
            stride: 4,
            min_positive: 0.375,
            max_positive: 0.625,
            positive_above: 0.0,
        }
    }
}

/// What to do with a group, given the rewards of its rollouts so far.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BarDecision {
    /// Train on these rollouts (indices into the rewards, ascending). `relaxed` when the
    /// band could not be met even at `n_max` (or with all rollouts there are).
    Select { indices: Vec<usize>, relaxed: bool },
    /// Generate this many more rollouts, then decide again.
    NeedMore(usize),
    /// No learning signal (all positive or all negative at `n_max`): drop the group.
    Drop,
}

/// Decides for one group. Rollouts are taken in the order they came (the earliest
/// positives and negatives), so the choice does not favour any rollout.
pub fn select(rewards: &[f64], cfg: &BarConfig) -> BarDecision {
    let n = cfg.n.max(1);
    let n_max = cfg.n_max.max(n);
    let have = rewards.len();
    if have < n {
        return BarDecision::NeedMore(n - have);
    }
    let pos: Vec<usize> = (0..have)
        .filter(|&i| rewards[i] > cfg.positive_above)
        .collect();
    let neg: Vec<usize> = (0..have)
        .filter(|&i| rewards[i] <= cfg.positive_above)
        .collect();
    // Positives allowed among n by the band, and by what exists.
    let lo = (cfg.min_positive * n as f64 - 1e-9).ceil().max(0.0) as usize;
    let hi = ((cfg.max_positive * n as f64 + 1e-9).floor() as usize).min(n);
    let feasible_lo = n.saturating_sub(neg.len());
    let feasible_hi = pos.len().min(n);
    let half = n / 2;
    let pick = |k: usize, relaxed: bool| {
        let mut indices: Vec<usize> = pos[..k]
            .iter()
            .chain(neg[..n - k].iter())
            .copied()
            .collect();
        indices.sort_unstable();
        BarDecision::Select { indices, relaxed }
    };
    let band_lo = lo.max(feasible_lo);
    let band_hi = hi.min(feasible_hi);
    if band_lo <= band_hi {
        return pick(half.clamp(band_lo, band_hi), false);
    }
    if have < n_max {
        return BarDecision::NeedMore(cfg.stride.max(1).min(n_max - have));
    }
    if pos.is_empty() || neg.is_empty() {
        return BarDecision::Drop;
    }
    // Relaxed: the feasible count nearest the band.
    let k = if feasible_hi < lo {
        feasible_hi
    } else {
        feasible_lo
    };
    pick(k, true)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rewards(bits: &str) -> Vec<f64> {
        bits.chars()
            .map(|c| if c == '1' { 1.0 } else { 0.0 })
            .collect()
    }

    fn positives(r: &[f64], d: &BarDecision) -> (usize, usize) {
        match d {
            BarDecision::Select { indices, .. } => (
                indices.len(),
                indices.iter().filter(|&&i| r[i] > 0.0).count(),
            ),
            other => panic!("expected a selection, got {other:?}"),
        }
    }

    #[test]
    fn fewer_than_n_asks_for_the_rest() {
        assert_eq!(
            select(&rewards("101"), &BarConfig::default()),
            BarDecision::NeedMore(5)
        );
    }

    #[test]
    fn balanced_first_stride_is_taken_as_is() {
        let r = rewards("10100110");
        let d = select(&r, &BarConfig::default());
        assert_eq!(
            d,
            BarDecision::Select {
                indices: (0..8).collect(),
                relaxed: false
            }
        );
    }

    #[test]
    fn skewed_first_stride_asks_for_one_more_stride() {
        // 7 of 8 positive: at most 5 may be, and only one negative exists.
        assert_eq!(
            select(&rewards("11111101"), &BarConfig::default()),
            BarDecision::NeedMore(4)
        );
    }

    #[test]
    fn second_stride_makes_the_band_reachable() {
        // 12 rollouts, 9 positive, 3 negative: 5 positives + 3 negatives.
        let r = rewards("111111011010");
        let d = select(&r, &BarConfig::default());
        assert_eq!(positives(&r, &d), (8, 5));
        // The earliest five positives and all three negatives.
        assert_eq!(
            d,
            BarDecision::Select {
                indices: vec![0, 1, 2, 3, 4, 6, 9, 11],
                relaxed: false
            }
        );
    }

    #[test]
    fn many_balanced_rollouts_pick_half_positive() {
        let r = rewards("1111111100000000");
        let d = select(&r, &BarConfig::default());
        assert_eq!(positives(&r, &d), (8, 4));
    }

    #[test]
    fn band_impossible_at_n_max_is_relaxed() {
        // 2 positives among 16: all 2 positives, 6 negatives, marked relaxed.
        let r = rewards("0001000000000100");
        let d = select(&r, &BarConfig::default());
        assert_eq!(positives(&r, &d), (8, 2));
        assert!(matches!(d, BarDecision::Select { relaxed: true, .. }));
        // And the mirror: 15 positives, 1 negative.
        let r = rewards("1111111111111110");
        let d = select(&r, &BarConfig::default());
        assert_eq!(positives(&r, &d), (8, 7));
        assert!(matches!(d, BarDecision::Select { relaxed: true, .. }));
    }

    #[test]
    fn groups_with_no_signal_are_dropped_only_at_n_max() {
        let all_zero = vec![0.0; 12];
        assert_eq!(
            select(&all_zero, &BarConfig::default()),
            BarDecision::NeedMore(4)
        );
        assert_eq!(select(&[0.0; 16], &BarConfig::default()), BarDecision::Drop);
        assert_eq!(select(&[1.0; 16], &BarConfig::default()), BarDecision::Drop);
    }

    #[test]
    fn continuous_rewards_use_the_threshold() {
        let cfg = BarConfig {
            positive_above: 0.5,
            ..BarConfig::default()
        };
        let r = [0.9, 0.2, 0.7, 0.4, 0.6, 0.1, 0.3, 0.8];
        assert_eq!(
            select(&r, &cfg),
            BarDecision::Select {
                indices: (0..8).collect(),
                relaxed: false
            }
        );
    }

    #[test]
    fn last_stride_is_cut_at_n_max() {
        let cfg = BarConfig {
            stride: 8,
            ..BarConfig::default()
        };
        assert_eq!(select(&[0.0; 12], &cfg), BarDecision::NeedMore(4));
    }
}
