//! What the scripted upstream keeps: its settings, the script and the tokenizer (read once at
//! start, shared read-only), the id counter, and each native side's state between requests
//! (weight version, pause, the logs tests read back).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::Value;
use tokio::sync::watch;

use crate::script::Script;
use crate::tokens::TokenModel;

pub(crate) struct State {
    pub(crate) model: Option<TokenModel>,
    pub(crate) script: Script,
    pub(crate) expect_key: Option<String>,
    pub(crate) admin_key: Option<String>,
    pub(crate) sglang_version: String,
    pub(crate) legacy_info_routes: bool,
    /// What vLLM's `GET /version` says (`--vllm-version`).
    pub(crate) vllm_version: String,
    pub(crate) chunk_delay: Duration,
    pub(crate) models: Vec<String>,
    pub(crate) next_id: AtomicU64,
    /// The SGLang-native side's state (weight version, pause).
    pub(crate) sglang: SglangSide,
    /// Whether vLLM's development routes are served (`--vllm-dev-mode`).
    pub(crate) vllm_dev_mode: bool,
    /// The vLLM-native side's state (weight version, pause) and log (requests, aborts).
    pub(crate) vllm: VllmSide,
    /// Every body the OpenAI routes were sent, for tests (`GET /testkit/openai/requests`).
    pub(crate) openai_bodies: Mutex<Vec<Value>>,
}

impl State {
    pub(crate) fn next_id(&self) -> u64 {
        self.next_id.fetch_add(1, Ordering::Relaxed)
    }
}

/// What the SGLang side keeps between requests.
pub(crate) struct SglangSide {
    pub(crate) weight_version: watch::Sender<String>,
    pub(crate) paused: watch::Sender<bool>,
    /// Each `/generate` request as it arrived (rid, sampling parameters, stream).
    pub(crate) seen: Mutex<Vec<Value>>,
    /// The rids `/abort_request` was called with.
    pub(crate) aborted: Mutex<Vec<String>>,
    /// Every POST to an SGLang route: `{path, body}`.
    pub(crate) bodies: Mutex<Vec<Value>>,
    /// Each `/generate` prompt as decoded text: `{rid, text}` (what the model was shown).
    pub(crate) prompts: Mutex<Vec<Value>>,
    /// Whether a weight-update session is open (`/begin_weight_update`).
    pub(crate) weight_session: Mutex<bool>,
}

impl Default for SglangSide {
    fn default() -> Self {
        SglangSide {
            weight_version: watch::Sender::new("default".to_string()),
            paused: watch::Sender::new(false),
            seen: Mutex::new(vec![]),
            aborted: Mutex::new(vec![]),
            bodies: Mutex::new(vec![]),
            prompts: Mutex::new(vec![]),
            weight_session: Mutex::new(false),
        }
    }
}

impl SglangSide {
    pub(crate) fn weight_version(&self) -> String {
        self.weight_version.borrow().clone()
    }
}

/// What the vLLM side keeps between requests.
pub(crate) struct VllmSide {
    pub(crate) seen: Mutex<Vec<Value>>,
    /// Request ids whose streamed answer was dropped before its end (the client went away).
    pub(crate) aborted: Arc<Mutex<Vec<String>>>,
    /// The version stamped on what is sampled (`EngineCore._weight_version`).
    pub(crate) weight_version: watch::Sender<String>,
    /// `/pause?mode=keep` until `/resume`: no generation steps.
    pub(crate) paused: watch::Sender<bool>,
    /// Every call of a development route: `{path, body}`.
    pub(crate) control: Mutex<Vec<Value>>,
    /// Where an old vLLM's `reload_weights()` reads from (`update_config`'s
    /// `model_config.model`).
    pub(crate) model_path: Mutex<Option<String>>,
}

impl Default for VllmSide {
    fn default() -> Self {
        VllmSide {
            seen: Mutex::default(),
            aborted: Arc::default(),
            weight_version: watch::Sender::new("default".to_string()),
            paused: watch::Sender::new(false),
            control: Mutex::default(),
            model_path: Mutex::default(),
        }
    }
}
