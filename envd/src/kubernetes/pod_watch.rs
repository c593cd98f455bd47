//! The Pod watch: one LIST+WATCH of this envd's Pods keeps every sandbox's [`PodState`].

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures_util::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use kube::api::Api;
use kube::runtime::watcher;
use tokio::sync::watch;
use tracing::{debug, warn};

use super::{PodState, SANDBOX_LABEL, lock};

/// The Pod watch: LIST, then WATCH from the list's resourceVersion; the watcher lists
/// again after `410 Gone` (an expired resourceVersion) or a broken stream. A re-list
/// replaces every state, so a Pod deleted while the watch was down is seen as gone.
pub(super) async fn watch_pods(
    api: Api<Pod>,
    selector: String,
    states: Arc<Mutex<HashMap<String, PodState>>>,
    changed: watch::Sender<u64>,
    lists: Arc<std::sync::atomic::AtomicU64>,
) {
    let cfg = watcher::Config::default().labels(&selector);
    let mut stream = watcher::watcher(api, cfg).boxed();
    let mut listing: Option<HashMap<String, PodState>> = None;
    let mut backoff = Duration::from_millis(100);
    let id_of = |p: &Pod| {
        p.metadata
            .labels
            .as_ref()
            .and_then(|l| l.get(SANDBOX_LABEL))
            .cloned()
    };
    let bump = || changed.send_modify(|n| *n += 1);
    while let Some(ev) = stream.next().await {
        match ev {
            Ok(watcher::Event::Init) => listing = Some(HashMap::new()),
            Ok(watcher::Event::InitApply(p)) => {
                if let (Some(l), Some(id)) = (listing.as_mut(), id_of(&p)) {
                    l.insert(id, PodState::of(&p));
                }
            }
            Ok(watcher::Event::InitDone) => {
                let listed = listing.take().unwrap_or_default();
                {
                    let mut s = lock(&states);
                    for (id, st) in s.iter_mut() {
                        match listed.get(id) {
                            Some(new) => *st = new.clone(),
                            // Listed before: its Pod is gone now. Never seen: its create
                            // may still be on the way.
                            None if !st.phase.is_empty() && st.phase != "Pending" => {
                                st.gone = true;
                            }
                            None => {}
                        }
                    }
                    for (id, st) in listed {
                        s.entry(id).or_insert(st);
                    }
                }
                lists.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                debug!("sandbox Pods listed");
                bump();
                backoff = Duration::from_millis(100);
            }
            Ok(watcher::Event::Apply(p)) => {
                if let Some(id) = id_of(&p) {
                    lock(&states).insert(id, PodState::of(&p));
                    bump();
                }
                backoff = Duration::from_millis(100);
            }
            Ok(watcher::Event::Delete(p)) => {
                if let Some(id) = id_of(&p)
                    && let Some(st) = lock(&states).get_mut(&id)
                {
                    st.gone = true;
                    bump();
                }
            }
            Err(e) => {
                // A 410 lands here too; the watcher lists again on the next poll.
                warn!(error = %e, "the sandbox Pod watch failed; listing again");
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_secs(10));
            }
        }
    }
}
