//! A logit row's best entries, for sampling without the whole row ([`crate::Ops::read_top`]): a
//! 248k-token vocabulary is 1 MB of logits a token, which a GPU would copy to the host and the
//! sampler scan every decode step, while the default sampler chain (top-k 40) and greedy
//! decoding only ever look at the best few and the tokens the penalties touch.

use std::cmp::Ordering;

/// Some entries of a logit row: its `k` best (by value with NaN as −∞, ties to the lower id)
/// and the extra ids asked for, by id ascending, each once, with their logits as the row holds
/// them (NaN included).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct TopRow {
    pub ids: Vec<u32>,
    pub vals: Vec<f32>,
}

impl TopRow {
    /// The row of some (id, value) entries, by id ascending, each id once (its first entry's
    /// value: every entry of an id holds the row's one value).
    pub fn from_pairs(mut pairs: Vec<(u32, f32)>) -> TopRow {
        pairs.sort_by_key(|p| p.0);
        pairs.dedup_by_key(|p| p.0);
        TopRow { ids: pairs.iter().map(|p| p.0).collect(), vals: pairs.iter().map(|p| p.1).collect() }
    }
}

/// What [`crate::Ops::read_top_begin`] gives: the rows already read, or a backend's read still
/// queued (its own type inside), which only that backend's [`crate::Ops::read_top_end`] opens.
pub enum TopRead {
    Ready(Vec<TopRow>),
    Queued(Box<dyn std::any::Any + Send>),
}

impl std::fmt::Debug for TopRead {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            TopRead::Ready(rows) => f.debug_tuple("Ready").field(&rows.len()).finish(),
            TopRead::Queued(_) => f.write_str("Queued"),
        }
    }
}

/// The order [`TopRow`] ranks by: larger value first (NaN as −∞), then the lower id.
pub fn rank(a: (u32, f32), b: (u32, f32)) -> Ordering {
    let v = |x: f32| if x.is_nan() { f32::NEG_INFINITY } else { x };
    v(b.1).total_cmp(&v(a.1)).then(a.0.cmp(&b.0))
}

/// The `k` best entries of `row` and those at `extra` (ids past the row are skipped): the
/// reference that device backends' selections must equal.
pub fn top_of_row(row: &[f32], k: usize, extra: &[u32]) -> TopRow {
    let mut best: Vec<u32> = if k >= row.len() {
        (0..row.len() as u32).collect()
    } else {
        let mut all: Vec<u32> = (0..row.len() as u32).collect();
        if k > 0 {
            all.select_nth_unstable_by(k - 1, |&a, &b| rank((a, row[a as usize]), (b, row[b as usize])));
        }
        all.truncate(k);
        all
    };
    best.extend(extra.iter().copied().filter(|&e| (e as usize) < row.len()));
    TopRow::from_pairs(best.into_iter().map(|i| (i, row[i as usize])).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ties_go_to_the_lower_id_and_nan_ranks_last() {
        let row = [1.0, f32::NAN, 3.0, 3.0, f32::NEG_INFINITY, 2.0, 3.0];
        assert_eq!(top_of_row(&row, 2, &[]).ids, [2, 3]);
        assert_eq!(top_of_row(&row, 4, &[]).ids, [2, 3, 5, 6]);
        // NaN and -inf rank below every number, among themselves by id.
        assert_eq!(top_of_row(&row, 6, &[]).ids, [0, 1, 2, 3, 5, 6]);
        let all = top_of_row(&row, 9, &[]);
        assert_eq!(all.ids, [0, 1, 2, 3, 4, 5, 6]);
        assert!(all.vals[1].is_nan());
    }

    #[test]
    fn extra_ids_join_once_and_past_the_row_are_skipped() {
        let row = [5.0, 4.0, 3.0, 2.0, 1.0];
        let t = top_of_row(&row, 2, &[4, 0, 4, 99]);
        assert_eq!(t.ids, [0, 1, 4]);
        assert_eq!(t.vals, [5.0, 4.0, 1.0]);
        assert_eq!(top_of_row(&row, 0, &[3]).ids, [3]);
        assert_eq!(top_of_row(&[], 3, &[0]), TopRow::default());
    }
}
