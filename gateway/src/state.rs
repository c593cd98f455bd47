//! Everything a request handler can reach (a leaf of the call pipeline: it names the parts,
//! the parts never name it).

use std::sync::Arc;

use graft_recorder::Recorder;

use crate::backend::Backend;
use crate::config::GatewayConfig;
use crate::limits::Limits;
use crate::metrics::Metrics;
use crate::sessions::Sessions;

pub struct State {
    pub cfg: GatewayConfig,
    pub recorder: Recorder,
    pub sessions: Sessions,
    pub limits: Limits,
    pub metrics: Arc<Metrics>,
    pub backend: Backend,
    /// Every session's recent attempts, to link retries (bounded over all sessions).
    pub retries: crate::retries::Retries,
    /// The pages under `/ui`, over this gateway's data dir.
    pub viewer: Arc<graft_viewer::Viewer>,
    /// The browser login of `/ui` (the admin key through a form, a cookie per login);
    /// `None` only under `auth.insecure_open_admin`, where no key exists.
    pub ui_login: Option<graft_viewer::login::Login>,
}
