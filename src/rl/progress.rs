//! The terminal view of a `graft rl` run: one live line (indicatif) with the step, the
//! rollouts running and done, the step's mean reward and its time, above which the per-rollout
//! and per-step lines scroll. When stderr is not a terminal the live line is hidden and only
//! the plain lines are printed (logs, CI).

use std::sync::Mutex;
use std::time::Duration;

use indicatif::{ProgressBar, ProgressStyle};

pub struct Progress {
    bar: ProgressBar,
    steps: usize,
    inner: Mutex<Counts>,
}

#[derive(Default)]
struct Counts {
    step: usize,
    training: Option<usize>,
    running: usize,
    done: usize,
    reward_sum: f64,
    scored: usize,
}

impl Progress {
    pub fn new(steps: usize) -> Progress {
        let bar = ProgressBar::new_spinner();
        if let Ok(style) = ProgressStyle::with_template("{spinner} {msg} [{elapsed}]") {
            bar.set_style(style);
        }
        bar.enable_steady_tick(Duration::from_millis(250));
        Progress {
            bar,
            steps,
            inner: Mutex::new(Counts::default()),
        }
    }

    fn counts(&self) -> std::sync::MutexGuard<'_, Counts> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Prints a line above the live one (or plainly when that is hidden).
    pub fn println(&self, line: impl AsRef<str>) {
        self.bar.suspend(|| println!("{}", line.as_ref()));
    }

    pub fn start_step(&self, step: usize) {
        let mut c = self.counts();
        let training = c.training;
        *c = Counts {
            step,
            training,
            ..Counts::default()
        };
        self.redraw(&c);
        self.bar.reset_elapsed();
    }

    /// `Some(step)` while that step trains (possibly under the next step's rollouts).
    pub fn training(&self, step: Option<usize>) {
        let mut c = self.counts();
        c.training = step;
        self.redraw(&c);
    }

    pub fn rollout_started(&self) {
        let mut c = self.counts();
        c.running += 1;
        self.redraw(&c);
    }

    pub fn rollout_done(&self, reward: Option<f64>) {
        let mut c = self.counts();
        c.running = c.running.saturating_sub(1);
        c.done += 1;
        if let Some(r) = reward {
            c.reward_sum += r;
            c.scored += 1;
        }
        self.redraw(&c);
    }

    fn redraw(&self, c: &Counts) {
        let reward = if c.scored == 0 {
            "–".to_string()
        } else {
            format!("{:.3}", c.reward_sum / c.scored as f64)
        };
        let training = match c.training {
            Some(s) => format!(" · training step {s}"),
            None => String::new(),
        };
        self.bar.set_message(format!(
            "step {}/{} · rollouts {} running, {} done · reward mean {reward}{training}",
            c.step + 1,
            self.steps,
            c.running,
            c.done
        ));
    }

    pub fn finish(&self) {
        self.bar.finish_and_clear();
    }
}
