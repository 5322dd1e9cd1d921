//! [`LayerGroups`]: how a model's layers share the pool's pages.
//!
//! A page holds the K and V of one *layer group* for `page_size` positions,
//! and a request holds one page run per group ([`crate::Lease`] is a lease
//! per group). Every group has equally many layers, so every page has one
//! size and any free page serves any group: memory moves between global
//! and sliding-window layers as the requests in flight need it.
//!
//! A group of global layers keeps every position. A group of
//! sliding-window layers ([`Keep::Window`]) keeps only what its next rows
//! can read: its lease slides forward as it is written, giving the pages
//! behind the window back to the pool, and never holds more than
//! [`LayerGroups::window_pages`] pages. A model without sliding windows is
//! one group of every layer: the pool as it always was.

use crate::error::PoolError;

/// Which positions a layer group keeps.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Keep {
    /// Every position: layers that attend to the whole context.
    All,
    /// The positions the next rows read: a row at position `p` of such a
    /// layer reads from `align_down(p + 1 − window, align)` (the kernel
    /// reads whole chunks of `align` positions and masks the rest), and
    /// one write stores at most `max_run` positions.
    Window {
        /// Positions a row sees: its own and the `window − 1` before it.
        window: usize,
        /// The granule reads start at.
        align: usize,
        /// The most positions one write of one request stores (a step's
        /// tokens).
        max_run: usize,
    },
}

/// The most positions a window, its alignment or one write may span. The
/// pages a window holds are counted from their sum, which must stay far
/// from overflowing; no context is longer.
pub const MAX_SPAN: usize = u32::MAX as usize;

impl Keep {
    /// Refuses a window whose numbers are zero or past [`MAX_SPAN`]: its
    /// page counts would divide by zero or overflow.
    fn check(self) -> Result<(), PoolError> {
        match self {
            Keep::All => Ok(()),
            Keep::Window {
                window,
                align,
                max_run,
            } => {
                if [window, align, max_run]
                    .iter()
                    .all(|n| (1..=MAX_SPAN).contains(n))
                {
                    Ok(())
                } else {
                    Err(PoolError::InvalidSpec {
                        reason: format!(
                            "window ({window}), alignment ({align}) and longest write \
                             ({max_run}) must each be between 1 and {MAX_SPAN} positions"
                        ),
                    })
                }
            }
        }
    }

    /// The first position a pass whose rows start at `past` reads.
    pub fn read_start(self, past: usize) -> usize {
        match self {
            Keep::All => 0,
            Keep::Window { window, align, .. } => {
                let first = (past + 1).saturating_sub(window);
                first - first % align
            }
        }
    }
}

/// The layer groups of a pool: each a list of model layers, all of one
/// length, and what it keeps.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LayerGroups {
    groups: Vec<(Vec<usize>, Keep)>,
    /// For each model layer, its group and its index inside the group.
    place: Vec<(usize, usize)>,
}

impl LayerGroups {
    /// Every one of `layers` layers in one group that keeps everything.
    pub fn single(layers: usize) -> LayerGroups {
        LayerGroups {
            groups: vec![((0..layers).collect(), Keep::All)],
            place: (0..layers).map(|layer| (0, layer)).collect(),
        }
    }

    /// The groups of a model of `windows.len()` layers where layer `i`
    /// attends through `windows[i]` (`None`: to everything): global layers
    /// and windowed layers each cut, in order, into groups of the largest
    /// size that divides both counts. Windowed layers must share one
    /// window. `align` and `max_run` as in [`Keep::Window`]. A model whose
    /// every layer is windowed is one group that keeps everything.
    pub fn of_windows(
        windows: &[Option<usize>],
        align: usize,
        max_run: usize,
    ) -> Result<LayerGroups, PoolError> {
        let invalid = |reason: String| Err(PoolError::InvalidSpec { reason });
        let global: Vec<usize> = (0..windows.len())
            .filter(|&l| windows[l].is_none())
            .collect();
        let local: Vec<usize> = (0..windows.len())
            .filter(|&l| windows[l].is_some())
            .collect();
        let window = match local.first().map(|&l| windows[l]) {
            None => return Ok(LayerGroups::single(windows.len())),
            Some(window) => window.expect("the filter kept windowed layers"),
        };
        if local.iter().any(|&l| windows[l] != Some(window)) {
            return invalid("windowed layers of different windows".into());
        }
        let keep = Keep::Window {
            window,
            align,
            max_run,
        };
        keep.check()?;
        // Every layer windowed (a small Gemma 3 has no global layer): no
        // group would say how long a context the pages hold, so the
        // layers keep every position, as one group.
        if global.is_empty() {
            return Ok(LayerGroups::single(windows.len()));
        }
        let size = gcd(global.len(), local.len());
        let groups = global
            .chunks(size)
            .map(|layers| (layers.to_vec(), Keep::All))
            .chain(local.chunks(size).map(|layers| (layers.to_vec(), keep)))
            .collect();
        LayerGroups::new(groups)
    }

    /// Groups as given: each a list of model layers and what it keeps.
    /// Refused unless every layer `0..n` is in exactly one group, the
    /// groups are equally long, and at least one keeps everything.
    pub fn new(groups: Vec<(Vec<usize>, Keep)>) -> Result<LayerGroups, PoolError> {
        let invalid = |reason: String| Err(PoolError::InvalidSpec { reason });
        let size = groups.first().map_or(0, |(layers, _)| layers.len());
        if size == 0 || groups.iter().any(|(layers, _)| layers.len() != size) {
            return invalid("layer groups must be non-empty and equally long".into());
        }
        if !groups.iter().any(|(_, keep)| *keep == Keep::All) {
            return invalid("at least one layer group must keep every position".into());
        }
        for (_, keep) in &groups {
            keep.check()?;
        }
        let layers = size * groups.len();
        let mut place = vec![None; layers];
        for (group, (members, _)) in groups.iter().enumerate() {
            for (index, &layer) in members.iter().enumerate() {
                match place.get_mut(layer) {
                    Some(slot @ None) => *slot = Some((group, index)),
                    _ => {
                        return invalid(format!("layer {layer} is out of range or in two groups"));
                    }
                }
            }
        }
        let place = place
            .into_iter()
            .map(|p| p.expect("n layers placed once each fill n places"))
            .collect();
        Ok(LayerGroups { groups, place })
    }

    /// Layers of the model.
    pub fn layers(&self) -> usize {
        self.place.len()
    }

    /// Layers in each group: what one page holds.
    pub fn group_size(&self) -> usize {
        self.groups[0].0.len()
    }

    /// How many groups.
    pub fn len(&self) -> usize {
        self.groups.len()
    }

    /// Whether there are no groups (never, for a validated value).
    pub fn is_empty(&self) -> bool {
        self.groups.is_empty()
    }

    /// Whether some group keeps only a window.
    pub fn is_windowed(&self) -> bool {
        self.groups.iter().any(|(_, keep)| *keep != Keep::All)
    }

    /// The group of model layer `layer` and its index there.
    pub fn place(&self, layer: usize) -> Option<(usize, usize)> {
        self.place.get(layer).copied()
    }

    /// The model layers group `group` holds, in the order a page stores
    /// them.
    pub fn members(&self, group: usize) -> &[usize] {
        &self.groups[group].0
    }

    /// What group `group` keeps.
    pub fn keep(&self, group: usize) -> Keep {
        self.groups[group].1
    }

    /// Pages a windowed group's lease holds at most, with `page_size`
    /// positions a page: a write of `max_run` positions at `p` needs
    /// `align_down(p + 1 − window, align)..p + max_run`, at most
    /// `max_run + window + align − 2` positions, which can straddle one
    /// page more than they fill.
    pub fn window_pages(keep: Keep, page_size: usize) -> Option<usize> {
        match keep {
            Keep::All => None,
            Keep::Window {
                window,
                align,
                max_run,
            } => Some((max_run + window + align - 2).div_ceil(page_size) + 1),
        }
    }

    /// Pages each group's lease holds for a request of `tokens` positions.
    pub fn pages_per_group(&self, tokens: usize, page_size: usize) -> Vec<usize> {
        let full = tokens.div_ceil(page_size);
        self.groups
            .iter()
            .map(|(_, keep)| {
                LayerGroups::window_pages(*keep, page_size).map_or(full, |most| full.min(most))
            })
            .collect()
    }

    /// Pages a request of `tokens` positions holds in all.
    pub fn pages_for(&self, tokens: usize, page_size: usize) -> usize {
        self.pages_per_group(tokens, page_size).iter().sum()
    }

    /// The longest request (whole pages) that `pages` pages hold.
    pub fn capacity_tokens(&self, pages: usize, page_size: usize) -> usize {
        // Pages grow by one per group until every window is full, then by
        // one per group that keeps everything.
        let (mut held, mut full) = (0, 0);
        let mut caps: Vec<usize> = self
            .groups
            .iter()
            .filter_map(|(_, keep)| LayerGroups::window_pages(*keep, page_size))
            .collect();
        caps.sort_unstable();
        let mut growing = self.groups.len();
        for cap in caps {
            let step = (cap - full) * growing;
            if held + step > pages {
                break;
            }
            held += step;
            full = cap;
            growing -= 1;
        }
        (full + (pages - held) / growing) * page_size
    }
}

fn gcd(a: usize, b: usize) -> usize {
    if b == 0 { a } else { gcd(b, a % b) }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gemma() -> LayerGroups {
        let windows: Vec<Option<usize>> = (0..18).map(|l| (l % 6 != 5).then_some(512)).collect();
        LayerGroups::of_windows(&windows, 128, 256).expect("valid groups")
    }

    #[test]
    fn gemma_3_is_one_global_group_and_five_windowed_ones_of_three_layers() {
        let groups = gemma();
        assert_eq!((groups.len(), groups.group_size()), (6, 3));
        assert_eq!(groups.place(5), Some((0, 0)));
        assert_eq!(groups.place(17), Some((0, 2)));
        assert_eq!(groups.place(0), Some((1, 0)));
        assert_eq!(groups.place(16), Some((5, 2)));
        assert_eq!(groups.place(18), None);
        assert_eq!(groups.keep(0), Keep::All);
    }

    #[test]
    fn a_long_context_costs_its_global_layers_and_a_window_for_the_rest() {
        let groups = gemma();
        // (256 + 512 + 126) / 16 rounded up, plus the straddled page.
        let window = LayerGroups::window_pages(groups.keep(1), 16);
        assert_eq!(window, Some(57));
        assert_eq!(groups.pages_for(100, 16), 6 * 7, "short: every group whole");
        assert_eq!(groups.pages_for(32_768, 16), 2048 + 5 * 57);
        // What full KV of 18 layers would cost, in pages of three layers.
        let full = 6 * 2048;
        assert!(groups.pages_for(32_768, 16) * 5 < full, "under a fifth");
        for pages in [6, 7, 6 * 57, 6 * 57 + 1, 2048 + 5 * 57, 10_000] {
            let tokens = groups.capacity_tokens(pages, 16);
            assert!(
                groups.pages_for(tokens, 16) <= pages,
                "{pages}: {tokens} fits"
            );
            assert!(
                groups.pages_for(tokens + 16, 16) > pages,
                "{pages}: {tokens} is the longest"
            );
        }
        assert_eq!(groups.capacity_tokens(2048 + 5 * 57, 16), 32_768);
    }

    #[test]
    fn reads_start_at_the_aligned_window() {
        let keep = Keep::Window {
            window: 512,
            align: 128,
            max_run: 1,
        };
        assert_eq!(keep.read_start(0), 0);
        assert_eq!(keep.read_start(511), 0);
        assert_eq!(keep.read_start(640), 128, "row 640 sees from 129");
        assert_eq!(keep.read_start(767), 256);
        assert_eq!(Keep::All.read_start(10_000), 0);
    }

    /// A window, alignment or longest write past `MAX_SPAN` made the page
    /// counts overflow (`kvfence pool plan --step-tokens 18446744073709551615`
    /// panicked in a debug build; a release build would have wrapped).
    #[test]
    fn windows_too_long_to_count_are_refused_and_the_longest_are_counted() {
        for (window, align, max_run) in [
            (usize::MAX, 128, 256),
            (512, usize::MAX, 256),
            (512, 128, usize::MAX),
            (MAX_SPAN + 1, 1, 1),
            (512, 0, 256),
        ] {
            let error = LayerGroups::of_windows(&[Some(window), None], align, max_run)
                .unwrap_err()
                .to_string();
            assert!(
                error.contains(&format!("longest write ({max_run})"))
                    && error.contains(&MAX_SPAN.to_string()),
                "{error}"
            );
            let keep = Keep::Window {
                window,
                align,
                max_run,
            };
            assert!(LayerGroups::new(vec![(vec![0], Keep::All), (vec![1], keep)]).is_err());
        }
        let windows: Vec<Option<usize>> =
            (0..18).map(|l| (l % 6 != 5).then_some(MAX_SPAN)).collect();
        let groups = LayerGroups::of_windows(&windows, MAX_SPAN, MAX_SPAN).expect("valid groups");
        for page_size in [1, 16] {
            let pages = groups.pages_for(MAX_SPAN, page_size);
            let tokens = groups.capacity_tokens(pages, page_size);
            assert!(groups.pages_for(tokens, page_size) <= pages);
        }
    }

    #[test]
    fn malformed_groups_are_refused() {
        let all = Keep::All;
        assert!(LayerGroups::new(vec![]).is_err());
        assert!(LayerGroups::new(vec![(vec![0, 1], all), (vec![2], all)]).is_err());
        assert!(LayerGroups::new(vec![(vec![0], all), (vec![0], all)]).is_err());
        assert!(LayerGroups::new(vec![(vec![0], all), (vec![2], all)]).is_err());
        let window = Keep::Window {
            window: 4,
            align: 1,
            max_run: 1,
        };
        assert!(LayerGroups::new(vec![(vec![0], window)]).is_err());
        assert_eq!(
            LayerGroups::of_windows(&[Some(4), Some(4)], 1, 1),
            Ok(LayerGroups::single(2)),
            "no global layer: one group that keeps everything"
        );
        assert!(LayerGroups::of_windows(&[Some(4), None, Some(8)], 1, 1).is_err());
        assert_eq!(
            LayerGroups::of_windows(&[None, None], 1, 1),
            Ok(LayerGroups::single(2))
        );
    }
}
