//! cgroup limits and process accounting for the local backend.
//!
//! v1 (separate hierarchies, as on this host): a sandbox gets
//! `{memory,cpu,pids}/graft-envd/<sandbox>/` with its limits, and every exec a child
//! `pids/graft-envd/<sandbox>/<job>/` so the job's processes can be listed and killed.
//! v2 (unified): `graft-envd/<sandbox>/` carries the limits and every exec runs in a leaf
//! `graft-envd/<sandbox>/<job>/`. A process joins by writing its own pid into the
//! `cgroup.procs` files (`join_files`) before it execs bubblewrap, so nothing it starts is
//! ever outside.

use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::model::Limits;

/// The parent of every envd instance's cgroups.
pub const PARENT: &str = "graft-envd";

/// `graft-envd/<hash of the data dir>`: instances with different data dirs never touch
/// each other's cgroups (and leftovers of a crashed run are found by the next one).
pub fn group_for(data_dir: &Path) -> PathBuf {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in data_dir.as_os_str().as_encoded_bytes() {
        h ^= u64::from(*b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    Path::new(PARENT).join(format!("{h:016x}"))
}

#[derive(Debug, Clone)]
pub enum Cgroups {
    V1 {
        root: PathBuf,
        group: PathBuf,
    },
    V2 {
        root: PathBuf,
        group: PathBuf,
    },
    /// No writable cgroup hierarchy (not root, or none mounted): no limits.
    None {
        why: String,
    },
}

fn write(path: &Path, value: &str) -> Result<(), String> {
    std::fs::write(path, value)
        .map_err(|e| format!("cannot write '{value}' to {}: {e}", path.display()))
}

fn mkdir(path: &Path) -> Result<(), String> {
    match std::fs::create_dir(path) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => Ok(()),
        Err(e) => Err(format!("cannot create cgroup {}: {e}", path.display())),
    }
}

fn chown(path: &Path, uid: Option<(u32, u32)>) -> Result<(), String> {
    if let Some((u, g)) = uid {
        std::os::unix::fs::chown(path, Some(u), Some(g))
            .map_err(|e| format!("cannot chown {}: {e}", path.display()))?;
    }
    Ok(())
}

/// Pids listed in a `cgroup.procs` file (empty when it is gone).
pub fn procs(file: &Path) -> Vec<i32> {
    std::fs::read_to_string(file)
        .map(|s| s.lines().filter_map(|l| l.trim().parse().ok()).collect())
        .unwrap_or_default()
}

impl Cgroups {
    /// Finds a writable hierarchy under `root` (normally /sys/fs/cgroup).
    pub fn detect(root: &Path, group: PathBuf) -> Cgroups {
        let v2 = root.join("cgroup.controllers");
        if v2.is_file() {
            let parent = root.join(PARENT);
            let mine = root.join(&group);
            let ctl = "+memory +pids +cpu";
            let _ = write(&root.join("cgroup.subtree_control"), ctl);
            let made = mkdir(&parent)
                .and_then(|()| write(&parent.join("cgroup.subtree_control"), ctl))
                .and_then(|()| mkdir(&mine))
                .and_then(|()| write(&mine.join("cgroup.subtree_control"), ctl));
            return match made {
                Ok(()) => Cgroups::V2 {
                    root: root.to_owned(),
                    group,
                },
                Err(why) => Cgroups::None { why },
            };
        }
        for c in ["memory", "pids", "cpu"] {
            let dir = root.join(c);
            if !dir.join("cgroup.procs").is_file() {
                return Cgroups::None {
                    why: format!("no cgroup v1 '{c}' controller at {}", dir.display()),
                };
            }
            if let Err(why) = mkdir(&dir.join(PARENT)).and_then(|()| mkdir(&dir.join(&group))) {
                return Cgroups::None { why };
            }
        }
        Cgroups::V1 {
            root: root.to_owned(),
            group,
        }
    }

    pub fn enforced(&self) -> bool {
        !matches!(self, Cgroups::None { .. })
    }

    /// Creates the sandbox's cgroups with its limits.
    pub fn create_sandbox(&self, sb: &str, limits: &Limits) -> Result<(), String> {
        let mem = (limits.memory_mb.saturating_mul(1 << 20)).to_string();
        let period: u64 = 100_000;
        let quota = ((limits.cpus * period as f64) as u64).max(1000);
        match self {
            Cgroups::V1 { root, group } => {
                let m = root.join("memory").join(group).join(sb);
                mkdir(&m)?;
                write(&m.join("memory.limit_in_bytes"), &mem)?;
                // Without swap accounting the file is absent; with it, swap is capped too.
                let _ = write(&m.join("memory.memsw.limit_in_bytes"), &mem);
                let p = root.join("pids").join(group).join(sb);
                mkdir(&p)?;
                write(&p.join("pids.max"), &limits.pids.to_string())?;
                let c = root.join("cpu").join(group).join(sb);
                mkdir(&c)?;
                write(&c.join("cpu.cfs_period_us"), &period.to_string())?;
                write(&c.join("cpu.cfs_quota_us"), &quota.to_string())?;
                Ok(())
            }
            Cgroups::V2 { root, group } => {
                let d = root.join(group).join(sb);
                mkdir(&d)?;
                write(&d.join("memory.max"), &mem)?;
                let _ = write(&d.join("memory.swap.max"), "0");
                write(&d.join("pids.max"), &limits.pids.to_string())?;
                write(&d.join("cpu.max"), &format!("{quota} {period}"))?;
                write(&d.join("cgroup.subtree_control"), "+memory +pids +cpu")?;
                Ok(())
            }
            Cgroups::None { .. } => Ok(()),
        }
    }

    /// The job's own cgroup: created, its `cgroup.procs` owned by `owner`. Returns the
    /// `cgroup.procs` files a process writes its pid into to join the sandbox and the job.
    pub fn create_job(
        &self,
        sb: &str,
        job: &str,
        owner: Option<(u32, u32)>,
    ) -> Result<Vec<PathBuf>, String> {
        match self {
            Cgroups::V1 { root, group } => {
                let m = root
                    .join("memory")
                    .join(group)
                    .join(sb)
                    .join("cgroup.procs");
                let c = root.join("cpu").join(group).join(sb).join("cgroup.procs");
                let j = root.join("pids").join(group).join(sb).join(job);
                mkdir(&j)?;
                let p = j.join("cgroup.procs");
                for f in [&m, &c, &p] {
                    chown(f, owner)?;
                }
                Ok(vec![m, c, p])
            }
            Cgroups::V2 { root, group } => {
                let j = root.join(group).join(sb).join(job);
                mkdir(&j)?;
                let p = j.join("cgroup.procs");
                chown(&p, owner)?;
                Ok(vec![p])
            }
            Cgroups::None { .. } => Ok(vec![]),
        }
    }

    fn job_procs_file(&self, sb: &str, job: &str) -> Option<PathBuf> {
        match self {
            Cgroups::V1 { root, group } => Some(
                root.join("pids")
                    .join(group)
                    .join(sb)
                    .join(job)
                    .join("cgroup.procs"),
            ),
            Cgroups::V2 { root, group } => {
                Some(root.join(group).join(sb).join(job).join("cgroup.procs"))
            }
            Cgroups::None { .. } => None,
        }
    }

    /// Host pids in the job's cgroup.
    pub fn job_pids(&self, sb: &str, job: &str) -> Vec<i32> {
        self.job_procs_file(sb, job)
            .map(|f| procs(&f))
            .unwrap_or_default()
    }

    /// SIGKILLs everything in the job's cgroup until it is empty, then removes it. Returns
    /// how many processes were killed, or an error naming the survivors.
    pub async fn kill_job(&self, sb: &str, job: &str) -> Result<usize, String> {
        let Some(file) = self.job_procs_file(sb, job) else {
            return Ok(0);
        };
        let dir = file.parent().map(Path::to_path_buf).unwrap_or_default();
        let killed = kill_all(&file).await?;
        remove_dir_retry(&dir).await?;
        Ok(killed)
    }

    /// Processes alive in the sandbox (its pids cgroup, children included).
    pub fn sandbox_processes(&self, sb: &str) -> Option<u64> {
        let f = match self {
            Cgroups::V1 { root, group } => {
                root.join("pids").join(group).join(sb).join("pids.current")
            }
            Cgroups::V2 { root, group } => root.join(group).join(sb).join("pids.current"),
            Cgroups::None { .. } => return None,
        };
        std::fs::read_to_string(f).ok()?.trim().parse().ok()
    }

    /// How many times the OOM killer has killed in the sandbox so far.
    pub fn oom_kills(&self, sb: &str) -> u64 {
        let (f, key) = match self {
            Cgroups::V1 { root, group } => (
                root.join("memory")
                    .join(group)
                    .join(sb)
                    .join("memory.oom_control"),
                "oom_kill",
            ),
            Cgroups::V2 { root, group } => {
                (root.join(group).join(sb).join("memory.events"), "oom_kill")
            }
            Cgroups::None { .. } => return 0,
        };
        std::fs::read_to_string(f)
            .ok()
            .and_then(|s| {
                s.lines().find_map(|l| {
                    let mut it = l.split_whitespace();
                    (it.next() == Some(key)).then(|| it.next()?.parse().ok())?
                })
            })
            .unwrap_or(0)
    }

    /// Kills whatever is left in the sandbox's cgroups and removes them.
    pub async fn remove_sandbox(&self, sb: &str) -> Result<(), String> {
        let dirs: Vec<PathBuf> = match self {
            Cgroups::V1 { root, group } => ["pids", "memory", "cpu"]
                .iter()
                .map(|c| root.join(c).join(group).join(sb))
                .collect(),
            Cgroups::V2 { root, group } => vec![root.join(group).join(sb)],
            Cgroups::None { .. } => return Ok(()),
        };
        for d in dirs {
            if !d.exists() {
                continue;
            }
            // Job cgroups first (children must go before the parent).
            if let Ok(rd) = std::fs::read_dir(&d) {
                for e in rd.flatten() {
                    let p = e.path();
                    if p.is_dir() {
                        kill_all(&p.join("cgroup.procs")).await?;
                        remove_dir_retry(&p).await?;
                    }
                }
            }
            kill_all(&d.join("cgroup.procs")).await?;
            remove_dir_retry(&d).await?;
        }
        Ok(())
    }

    /// Removes this instance's (empty) group when envd stops.
    pub fn remove_group(&self) {
        match self {
            Cgroups::V1 { root, group } => {
                for c in ["pids", "memory", "cpu"] {
                    let _ = std::fs::remove_dir(root.join(c).join(group));
                }
            }
            Cgroups::V2 { root, group } => {
                let _ = std::fs::remove_dir(root.join(group));
            }
            Cgroups::None { .. } => {}
        }
    }

    /// Names of the sandbox cgroups left by an earlier run.
    pub fn leftovers(&self) -> Vec<String> {
        let dir = match self {
            Cgroups::V1 { root, group } => root.join("pids").join(group),
            Cgroups::V2 { root, group } => root.join(group),
            Cgroups::None { .. } => return vec![],
        };
        std::fs::read_dir(dir)
            .map(|rd| {
                rd.flatten()
                    .filter(|e| e.path().is_dir())
                    .map(|e| e.file_name().to_string_lossy().into_owned())
                    .collect()
            })
            .unwrap_or_default()
    }
}

/// SIGKILLs every pid in a `cgroup.procs` file until it reads empty (a process may fork
/// between the read and the kill; the loop catches the child on the next round).
async fn kill_all(file: &Path) -> Result<usize, String> {
    let mut killed = 0;
    for _ in 0..200 {
        let pids = procs(file);
        if pids.is_empty() {
            return Ok(killed);
        }
        for p in pids {
            if let Some(pid) = rustix::process::Pid::from_raw(p)
                && rustix::process::kill_process(pid, rustix::process::Signal::KILL).is_ok()
            {
                killed += 1;
            }
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    Err(format!(
        "processes {:?} in {} survived SIGKILL for 2 s",
        procs(file),
        file.display()
    ))
}

async fn remove_dir_retry(dir: &Path) -> Result<(), String> {
    let mut last = String::new();
    for _ in 0..100 {
        match std::fs::remove_dir(dir) {
            Ok(()) => return Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
            // EBUSY while the kernel finishes tearing down the last exited task.
            Err(e) => last = e.to_string(),
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    Err(format!("cannot remove cgroup {}: {last}", dir.display()))
}

#[cfg(test)]
mod tests {
    //! The layouts against a fake cgroup root (plain directories and files): which files
    //! get which values. The real v1 hierarchy is exercised by tests/envd.rs; this is the
    //! only check of the v2 layout on a v1 host.
    use super::*;

    fn limits() -> Limits {
        Limits {
            cpus: 0.5,
            memory_mb: 64,
            pids: 40,
        }
    }

    fn read(p: PathBuf) -> String {
        std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
    }

    #[test]
    fn v2_layout_limits_leaf_jobs_and_oom_count() {
        let root = tempfile::tempdir().unwrap();
        std::fs::write(root.path().join("cgroup.controllers"), "cpu memory pids\n").unwrap();
        let group = group_for(Path::new("/data"));
        let cg = Cgroups::detect(root.path(), group.clone());
        assert!(matches!(cg, Cgroups::V2 { .. }), "{cg:?}");
        let mine = root.path().join(&group);
        assert_eq!(
            read(mine.join("cgroup.subtree_control")),
            "+memory +pids +cpu"
        );
        cg.create_sandbox("sb1", &limits()).unwrap();
        let sb = mine.join("sb1");
        assert_eq!(read(sb.join("memory.max")), (64u64 << 20).to_string());
        assert_eq!(read(sb.join("pids.max")), "40");
        assert_eq!(read(sb.join("cpu.max")), "50000 100000");
        assert_eq!(read(sb.join("memory.swap.max")), "0");
        let join = cg.create_job("sb1", "job-1", None).unwrap();
        assert_eq!(join, vec![sb.join("job-1").join("cgroup.procs")]);
        std::fs::write(
            sb.join("memory.events"),
            "low 0\nhigh 0\nmax 3\noom 1\noom_kill 2\n",
        )
        .unwrap();
        assert_eq!(cg.oom_kills("sb1"), 2);
        std::fs::write(sb.join("pids.current"), "7\n").unwrap();
        assert_eq!(cg.sandbox_processes("sb1"), Some(7));
        assert_eq!(cg.leftovers(), vec!["sb1".to_owned()]);
    }

    #[test]
    fn v1_layout_splits_controllers_and_puts_jobs_under_pids() {
        let root = tempfile::tempdir().unwrap();
        for c in ["memory", "pids", "cpu"] {
            std::fs::create_dir(root.path().join(c)).unwrap();
            std::fs::write(root.path().join(c).join("cgroup.procs"), "").unwrap();
        }
        let group = group_for(Path::new("/data"));
        let cg = Cgroups::detect(root.path(), group.clone());
        assert!(matches!(cg, Cgroups::V1 { .. }), "{cg:?}");
        cg.create_sandbox("sb1", &limits()).unwrap();
        let at = |c: &str| root.path().join(c).join(&group).join("sb1");
        assert_eq!(
            read(at("memory").join("memory.limit_in_bytes")),
            (64u64 << 20).to_string()
        );
        assert_eq!(read(at("pids").join("pids.max")), "40");
        assert_eq!(read(at("cpu").join("cpu.cfs_quota_us")), "50000");
        assert_eq!(read(at("cpu").join("cpu.cfs_period_us")), "100000");
        let join = cg.create_job("sb1", "job-1", None).unwrap();
        assert_eq!(
            join,
            vec![
                at("memory").join("cgroup.procs"),
                at("cpu").join("cgroup.procs"),
                at("pids").join("job-1").join("cgroup.procs"),
            ]
        );
        std::fs::write(
            at("memory").join("memory.oom_control"),
            "oom_kill_disable 0\nunder_oom 0\noom_kill 5\n",
        )
        .unwrap();
        assert_eq!(cg.oom_kills("sb1"), 5);
    }

    #[test]
    fn no_hierarchy_means_no_limits_and_says_why() {
        let root = tempfile::tempdir().unwrap();
        let cg = Cgroups::detect(root.path(), group_for(Path::new("/d")));
        match &cg {
            Cgroups::None { why } => assert!(why.contains("memory"), "{why}"),
            other => panic!("{other:?}"),
        }
        assert!(!cg.enforced());
        assert_eq!(
            cg.create_job("s", "j", None).unwrap(),
            Vec::<PathBuf>::new()
        );
        assert_eq!(cg.sandbox_processes("s"), None);
    }
}
