//! Process trees from `/proc`: what a timeout or a kill has to take down when the agent is
//! not the pid 1 of a PID namespace (the Kubernetes backend: the agent serves inside an
//! ordinary container). Each exec runs under a shim that is a child subreaper, so every
//! orphan of the exec — double-forked, `setsid`'d — is reparented to the shim, never to the
//! container's pid 1: the shim's descendants are exactly the exec's processes.

use std::collections::HashMap;
use std::time::Duration;

use rustix::process::{Pid, Signal};

/// Parent pid and state letter of a process, from `/proc/<pid>/stat`.
pub fn stat(pid: i32) -> Option<(i32, char)> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let rest = &s[s.rfind(')')? + 1..];
    let mut it = rest.split_whitespace();
    let state = it.next()?.chars().next()?;
    let ppid = it.next()?.parse().ok()?;
    Some((ppid, state))
}

/// Every process below `root` (children, their children, ...), not `root` itself.
pub fn descendants(root: i32) -> Vec<i32> {
    let mut children: HashMap<i32, Vec<i32>> = HashMap::new();
    if let Ok(rd) = std::fs::read_dir("/proc") {
        for e in rd.flatten() {
            let Some(pid) = e.file_name().to_str().and_then(|s| s.parse::<i32>().ok()) else {
                continue;
            };
            if let Some((ppid, _)) = stat(pid) {
                children.entry(ppid).or_default().push(pid);
            }
        }
    }
    let mut out = Vec::new();
    let mut todo = vec![root];
    while let Some(p) = todo.pop() {
        if let Some(c) = children.get(&p) {
            for &c in c {
                out.push(c);
                todo.push(c);
            }
        }
    }
    out
}

pub fn signal(pid: i32, sig: Signal) {
    if let Some(p) = Pid::from_raw(pid) {
        let _ = rustix::process::kill_process(p, sig);
    }
}

/// Reaps exited children of this process that are not in `keep` (their owners wait for
/// them), without blocking.
pub fn reap_zombies_except(keep: &dyn Fn(i32) -> bool) {
    let me = rustix::process::getpid().as_raw_nonzero().get();
    for pid in descendants(me) {
        if keep(pid) {
            continue;
        }
        if let Some((ppid, 'Z')) = stat(pid)
            && ppid == me
            && let Some(p) = Pid::from_raw(pid)
        {
            let _ = rustix::process::waitpid(Some(p), rustix::process::WaitOptions::NOHANG);
        }
    }
}

/// SIGKILLs every descendant of `root` until none is left (a fork racing the sweep is
/// caught by the next round). Returns how many were signalled; `reap` is called between
/// rounds (a subreaper must reap what it killed, or the zombies stay its descendants).
pub fn kill_descendants(root: i32, reap: &dyn Fn()) -> usize {
    let mut n = 0;
    for _ in 0..500 {
        let live: Vec<i32> = descendants(root)
            .into_iter()
            .filter(|&p| !matches!(stat(p), Some((_, 'Z')) | None))
            .collect();
        if live.is_empty() {
            break;
        }
        for &p in &live {
            signal(p, Signal::KILL);
        }
        n += live.len();
        reap();
        std::thread::sleep(Duration::from_millis(5));
    }
    reap();
    n
}
