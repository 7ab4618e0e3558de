//! One load task split into parts that run on several of an adapter's threads at once, so a
//! large load (a lookup's whole prefix) has as many copies or reads in flight as the adapter has
//! threads. The task still completes once, with every sink in the order submitted.

use parking_lot::Mutex;

use crate::{Bitmap, Completion, LoadItem, TaskId};

/// The parts of one split load task. Each part hands its sinks back through
/// [`JointLoad::part_done`]; the part that finishes last gets the task's one completion.
pub struct JointLoad {
    task: TaskId,
    state: Mutex<JointState>,
}

struct JointState {
    sinks: Vec<Option<LoadItem>>,
    loaded: Bitmap,
    parts_left: usize,
}

impl JointLoad {
    /// Splits `items` into at most `parts` contiguous parts (at least one), each with the index
    /// of its first item, and the joint record they report to.
    pub fn split(
        task: TaskId,
        items: Vec<LoadItem>,
        parts: usize,
    ) -> (std::sync::Arc<JointLoad>, Vec<(usize, Vec<LoadItem>)>) {
        let total = items.len();
        let per_part = total.div_ceil(parts.max(1)).max(1);
        let mut rest = items;
        let mut split = Vec::with_capacity(parts);
        let mut first = 0;
        while !rest.is_empty() {
            let tail = rest.split_off(per_part.min(rest.len()));
            let part = std::mem::replace(&mut rest, tail);
            let len = part.len();
            split.push((first, part));
            first += len;
        }
        let joint = JointLoad {
            task,
            state: Mutex::new(JointState {
                sinks: (0..total).map(|_| None).collect(),
                loaded: Bitmap::new(total),
                parts_left: split.len(),
            }),
        };
        (std::sync::Arc::new(joint), split)
    }

    /// The task the parts belong to.
    pub fn task(&self) -> TaskId {
        self.task
    }

    /// Records a finished part (the items from `first` on, and which of them loaded; a part that
    /// failed as a whole passes an empty bitmap); the task's completion once every part is in.
    pub fn part_done(
        &self,
        first: usize,
        items: Vec<LoadItem>,
        loaded: &Bitmap,
    ) -> Option<Completion> {
        let mut state = self.state.lock();
        for (i, item) in items.into_iter().enumerate() {
            state.loaded.set(first + i, loaded.get(i));
            if let Some(slot) = state.sinks.get_mut(first + i) {
                *slot = Some(item);
            }
        }
        state.parts_left = state.parts_left.saturating_sub(1);
        if state.parts_left > 0 {
            return None;
        }
        let sinks: Vec<LoadItem> = std::mem::take(&mut state.sinks).into_iter().flatten().collect();
        let loaded = std::mem::replace(&mut state.loaded, Bitmap::new(0));
        Some(Completion::Loaded { task: self.task, loaded, sinks })
    }
}
