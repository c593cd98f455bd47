//! The seam between the service and where sandboxes run. The service (registry, jobs,
//! idempotency keys, TTLs, validation) is the same for every backend and holds one
//! `Arc<dyn SandboxBackend>`, chosen once by `--backend`:
//!
//! - [`crate::local::LocalBackend`]: bubblewrap + cgroups on this host;
//! - [`crate::kubernetes::KubeBackend`]: a Pod per sandbox, exec and files through its agent.
//!
//! A backend keeps what it knows of each sandbox (directories and a forward task; a Pod
//! name, a token and files still to write) inside itself, keyed by the sandbox id, so the
//! service never asks which backend made a sandbox. The methods return boxed futures so the
//! trait can be used as a trait object; each implementation forwards to inherent `async fn`s.

use std::collections::HashSet;
use std::path::Path;
use std::time::Duration;

use bytes::Bytes;
use futures_util::future::BoxFuture;
use tokio::sync::{broadcast, watch};

use crate::error::EnvdError;
use crate::model::{
    CreateSandbox, DirEntry, ExecSpec, JobInfo, OutputEvent, SandboxSpec, SnapshotInfo,
};

/// The sandbox ids the service knows (live or being created), read by a reconcile after it
/// has listed what the backend holds.
pub type KnownIds<'a> = &'a (dyn Fn() -> HashSet<String> + Send + Sync);

/// Where sandboxes live. Every method naming a sandbox id is called only for an id the
/// backend created (and has not deleted); an unknown id is answered with
/// [`EnvdError::SandboxNotFound`].
pub trait SandboxBackend: Send + Sync {
    /// `local` or `kubernetes`, as the API reports it.
    fn name(&self) -> &'static str;

    /// Whether cpu and memory limits are enforced (cgroups here; the kubelet for Pods).
    fn limits_enforced(&self) -> bool;

    /// Refuses, before anything is reserved or made, a create this backend cannot serve
    /// (an id its objects cannot be named after, fields it has no use for).
    fn check_create(&self, _id: &str, _req: &CreateSandbox) -> Result<(), EnvdError> {
        Ok(())
    }

    /// Makes the sandbox (the id is reserved by the service meanwhile). On an error nothing
    /// of it is left behind.
    fn create(&self, spec: SandboxSpec) -> BoxFuture<'_, Result<(), EnvdError>>;

    /// Waits until the sandbox can serve execs and files (a Pod: ready by the watch, its
    /// harness files written); `None` is the backend's default wait.
    fn ready<'a>(
        &'a self,
        id: &'a str,
        timeout: Option<Duration>,
    ) -> BoxFuture<'a, Result<(), EnvdError>>;

    /// `pending`, `ready` or `failed`, as the API reports the sandbox.
    fn state(&self, id: &str) -> &'static str;

    /// Tasks alive in the sandbox now, where the backend can count them.
    fn processes(&self, id: &str) -> Option<u64>;

    /// Whether `rel` is a directory of the workspace, checked before an exec starts there
    /// (`true` where the backend's own exec reports a missing cwd).
    fn cwd_exists(&self, id: &str, rel: &Path) -> Result<bool, EnvdError>;

    /// Runs one exec to its end (or its timeout, or `kill`), streaming its output to
    /// `events`. Never fails: a failure is a job in state `failed`.
    fn exec<'a>(
        &'a self,
        id: &'a str,
        job: &'a str,
        spec: ExecSpec,
        base: JobInfo,
        events: broadcast::Sender<OutputEvent>,
        kill: watch::Receiver<bool>,
    ) -> BoxFuture<'a, JobInfo>;

    fn list_files<'a>(
        &'a self,
        id: &'a str,
        rel: &'a Path,
    ) -> BoxFuture<'a, Result<Vec<DirEntry>, EnvdError>>;

    /// The file's bytes, at most `max` of them (a larger file is [`EnvdError::TooLarge`]).
    fn read_file<'a>(
        &'a self,
        id: &'a str,
        rel: &'a Path,
        max: usize,
    ) -> BoxFuture<'a, Result<Vec<u8>, EnvdError>>;

    /// Writes the file (parents created); returns the bytes written.
    fn write_file<'a>(
        &'a self,
        id: &'a str,
        rel: &'a Path,
        data: Bytes,
        mode: u32,
    ) -> BoxFuture<'a, Result<u64, EnvdError>>;

    fn remove_file<'a>(
        &'a self,
        id: &'a str,
        rel: &'a Path,
        recursive: bool,
    ) -> BoxFuture<'a, Result<(), EnvdError>>;

    /// Removes the sandbox and whatever is left running in it (its jobs are ended first by
    /// the service). The backend forgets it even when part of the removal failed.
    fn delete<'a>(&'a self, id: &'a str) -> BoxFuture<'a, Result<(), EnvdError>>;

    /// Copies the sandbox's workspace into snapshot `snapshot` (a fresh id; the service
    /// checked it) and returns what was stored.
    fn snapshot<'a>(
        &'a self,
        id: &'a str,
        snapshot: &'a str,
    ) -> BoxFuture<'a, Result<SnapshotInfo, EnvdError>>;

    /// The snapshots an earlier run left (they are data; sandboxes are not kept).
    fn saved_snapshots(&self) -> Vec<SnapshotInfo> {
        Vec::new()
    }

    /// Removes a stored snapshot (the service checked that no sandbox forks it).
    fn delete_snapshot(&self, _snapshot: &str) -> Result<(), EnvdError> {
        Ok(())
    }

    /// Removes what the backend holds that no sandbox of `known` owns (left by an earlier
    /// envd or a create that failed half-way); at most once per the backend's interval
    /// unless `force`. Returns how many were removed.
    fn reconcile<'a>(
        &'a self,
        _force: bool,
        _known: KnownIds<'a>,
    ) -> BoxFuture<'a, Result<usize, EnvdError>> {
        Box::pin(async { Ok(0) })
    }

    /// What is left to clean once every sandbox is deleted.
    fn shutdown(&self) {}
}
