//! The shuffle step's first half, the augmented shuffle (the Combee paper's,
//! see `docs/learning.md`): every reflection appears p times and the
//! augmented list is shuffled with the round's seed, so each insight gets
//! several chances to land in a group and a resumed round regroups identically.

use rand::SeedableRng;
use rand::seq::SliceRandom;
use rand_chacha::ChaCha8Rng;

/// Indices into a list of `n` items, each repeated `p` times, shuffled by
/// Fisher–Yates with a ChaCha8 RNG seeded from `seed`. Deterministic for a
/// given `(n, p, seed)` across platforms and runs.
pub fn augmented_indices(n: usize, p: u32, seed: u64) -> Vec<usize> {
    let mut out: Vec<usize> = (0..p).flat_map(|_| 0..n).collect();
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    // `SliceRandom::shuffle` is a Fisher–Yates shuffle; its output is stable for a given RNG stream.
    out.shuffle(&mut rng);
    out
}

/// The items themselves, each repeated `p` times, in the order of [`augmented_indices`].
pub fn augment_and_shuffle<T: Clone>(items: &[T], p: u32, seed: u64) -> Vec<T> {
    augmented_indices(items.len(), p, seed).into_iter().map(|i| items[i].clone()).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn counts(idx: &[usize], n: usize) -> Vec<usize> {
        let mut c = vec![0; n];
        for &i in idx {
            c[i] += 1;
        }
        c
    }

    #[test]
    fn every_item_appears_exactly_p_times() {
        for p in [1, 2, 3] {
            let idx = augmented_indices(17, p, 42);
            assert_eq!(idx.len(), 17 * p as usize);
            assert!(counts(&idx, 17).iter().all(|&c| c == p as usize));
        }
    }

    #[test]
    fn same_seed_same_order_different_seed_different_order() {
        let items: Vec<String> = (0..20).map(|i| format!("r{i}")).collect();
        let a = augment_and_shuffle(&items, 2, 7);
        assert_eq!(a, augment_and_shuffle(&items, 2, 7));
        assert_ne!(a, augment_and_shuffle(&items, 2, 8));
    }

    #[test]
    fn p_one_is_a_permutation_and_actually_shuffles() {
        let idx = augmented_indices(50, 1, 1);
        let mut sorted = idx.clone();
        sorted.sort_unstable();
        assert_eq!(sorted, (0..50).collect::<Vec<_>>());
        assert_ne!(idx, sorted);
    }

    #[test]
    fn degenerate_inputs_are_empty() {
        assert!(augmented_indices(0, 2, 1).is_empty());
        assert!(augmented_indices(5, 0, 1).is_empty());
        assert!(augment_and_shuffle::<u8>(&[], 3, 1).is_empty());
    }
}
