//! Where a create goes: the better of two hosts drawn at random among those that take
//! sandboxes of its image and have its memory free, by their last health figures ("the power
//! of two choices"); then, if that one refuses (`503 no_capacity`) or does not answer, the rest
//! by free memory. Not the least loaded host: several gateway replicas, each with figures up to
//! a poll old, would all send their creates to that same host until their next poll, and each
//! such burst ends in refusals and retries; two random choices spread the same burst and still
//! fill the emptier hosts first (`the_better_of_two_spreads_bursts_that_least_loaded_herds`
//! simulates a fleet's fill with both).

/// A small, fast generator for the random choices (not for anything secret).
pub struct Rng(u64);

impl Rng {
    /// Seeded from the clock and the process.
    pub fn new() -> Rng {
        let t = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64);
        Rng::seeded(t ^ u64::from(std::process::id()).rotate_left(32))
    }

    /// Seeded with `seed` (tests).
    pub fn seeded(seed: u64) -> Rng {
        Rng(seed | 1)
    }

    /// A number below `n` (`n` > 0).
    pub fn below(&mut self, n: usize) -> usize {
        // xorshift64*
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        (self.0.wrapping_mul(0x2545_F491_4F6C_DD1D) % n as u64) as usize
    }
}

impl Default for Rng {
    fn default() -> Rng {
        Rng::new()
    }
}

/// The order in which to try the hosts whose free memory is `free[i]` for a sandbox of `want`
/// MiB (only the hosts that take this create: the caller filters by image and state): the better
/// of two drawn among those with room, then every other by free memory, most first.
pub fn order(free: &[u64], want: u64, rng: &mut Rng) -> Vec<usize> {
    let roomy: Vec<usize> = (0..free.len()).filter(|&i| free[i] >= want).collect();
    let mut rest: Vec<usize> = (0..free.len()).collect();
    rest.sort_by_key(|&i| std::cmp::Reverse(free[i]));
    let first = match roomy.len() {
        0 => None,
        1 => Some(roomy[0]),
        n => {
            let a = roomy[rng.below(n)];
            let mut b = roomy[rng.below(n - 1)];
            if b == a {
                b = roomy[n - 1];
            }
            Some(if free[b] > free[a] { b } else { a })
        }
    };
    if let Some(f) = first {
        rest.retain(|&i| i != f);
        rest.insert(0, f);
    }
    rest
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_chosen_host_has_room_and_every_host_is_tried() {
        let mut rng = Rng::seeded(7);
        for _ in 0..1000 {
            let o = order(&[100, 5000, 3000, 0], 4096, &mut rng);
            assert_eq!(o[0], 1, "only one has room");
            let mut sorted = o.clone();
            sorted.sort();
            assert_eq!(sorted, [0, 1, 2, 3]);
        }
        // None with room: the most free first (the figures may be a poll old).
        assert_eq!(order(&[100, 300, 200], 4096, &mut rng), [1, 2, 0]);
        assert!(order(&[], 1, &mut rng).is_empty());
    }

    /// A fleet of hosts filled by several gateways whose figures are a poll old, with runs
    /// ending at random: how many creates a host refused (it was full when the create came)
    /// and how unevenly the hosts were filled, by each way of choosing. Printed, and the better
    /// of two must refuse fewer.
    fn simulate(better_of_two: bool) -> (u64, f64) {
        const HOSTS: usize = 8;
        const ROOM: u64 = 64 * 1024;
        const RUN: u64 = 4096;
        const GATEWAYS: usize = 3;
        const POLL_EVERY: usize = 12; // creates per gateway between two polls
        let mut rng = Rng::seeded(42);
        let mut used = [0u64; HOSTS];
        let mut runs: Vec<usize> = vec![];
        let mut views = [[0u64; HOSTS]; GATEWAYS];
        let (mut refused, mut spread) = (0u64, 0.0);
        for step in 0..4000 {
            let g = step % GATEWAYS;
            if step % (GATEWAYS * POLL_EVERY) < GATEWAYS {
                views[g] = used.map(|u| ROOM - u);
            }
            // About as many runs end as start, around 70 % of the fleet.
            if runs.len() > HOSTS * 11 || (!runs.is_empty() && rng.below(3) == 0) {
                let h = runs.swap_remove(rng.below(runs.len()));
                used[h] -= RUN;
            }
            let free = views[g];
            let tries = if better_of_two {
                order(&free, RUN, &mut rng)
            } else {
                let mut o: Vec<usize> = (0..HOSTS).collect();
                o.sort_by_key(|&i| std::cmp::Reverse(free[i]));
                o
            };
            for h in tries {
                if used[h] + RUN <= ROOM {
                    used[h] += RUN;
                    runs.push(h);
                    views[g][h] = views[g][h].saturating_sub(RUN);
                    break;
                }
                refused += 1;
            }
            if step >= 1000 {
                let mean = used.iter().sum::<u64>() as f64 / HOSTS as f64;
                let var =
                    used.iter().map(|&u| (u as f64 - mean).powi(2)).sum::<f64>() / HOSTS as f64;
                spread += var.sqrt() / 3000.0;
            }
        }
        (refused, spread)
    }

    #[test]
    fn the_better_of_two_spreads_bursts_that_least_loaded_herds() {
        let (two_refused, two_spread) = simulate(true);
        let (least_refused, least_spread) = simulate(false);
        eprintln!(
            "8 hosts of 64 GiB, 3 gateways a poll behind, 4 GiB runs: better of two: {two_refused} \
             refusals, hosts' use spread (standard deviation) {two_spread:.0} MiB; least loaded: \
             {least_refused} refusals, spread {least_spread:.0} MiB"
        );
        assert!(
            two_refused < least_refused,
            "{two_refused} >= {least_refused}"
        );
    }
}
