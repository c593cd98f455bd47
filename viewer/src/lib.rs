//! graft's web viewer: server-rendered pages over a recorder data dir (sessions, groups, a
//! session's calls as the conversation), an RL run's samples (tokens with the trained ones
//! marked, logprob heat) and its `steps.jsonl` (SVG charts, one point per step).
//!
//! [`Viewer::page`] answers one GET by path and query; whoever serves it (`graft view`, the
//! gateway's `/ui`) owns the listener and the admin key. Pages are self-contained: the
//! stylesheet is inline, charts are inline SVG, nothing is fetched from anywhere.

mod conversation;
pub mod login;
pub mod svg;

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::SystemTime;

use graft_reconstruct::sample::Sample;
use graft_reconstruct::template::Tokenizer;
use graft_recorder::{CallRecord, SessionSummary};
use minijinja::Environment;
use serde_json::{Value, json};

pub use conversation::Msg;

#[derive(Debug, thiserror::Error)]
pub enum ViewError {
    #[error("cannot read the records in {dir}: {source}")]
    Records {
        dir: PathBuf,
        source: graft_recorder::RecorderError,
    },
    #[error("cannot read {path}: {message}")]
    Read { path: PathBuf, message: String },
    /// A file the page names is there but is not what it should be (a damaged or foreign
    /// `.parquet`): the request's fault as much as anyone's, never a 500.
    #[error("{path} {message}")]
    BadFile { path: PathBuf, message: String },
    #[error("{0}")]
    NotFound(String),
    #[error("bad query: {0}")]
    BadQuery(String),
    #[error("page template {name} failed: {message}")]
    Template { name: String, message: String },
}

impl ViewError {
    pub fn status(&self) -> u16 {
        match self {
            ViewError::NotFound(_) => 404,
            ViewError::BadQuery(_) => 400,
            ViewError::BadFile { .. } => 422,
            _ => 500,
        }
    }
}

/// One answered page.
#[derive(Debug, Clone)]
pub struct Page {
    pub status: u16,
    pub content_type: &'static str,
    pub body: String,
}

/// Headers every page is served with, by whoever serves it: never cached, no script, nothing
/// loaded from elsewhere (inline styles and `data:` images only), no content sniffing.
pub const RESPONSE_HEADERS: [(&str, &str); 3] = [
    ("cache-control", "no-store"),
    (
        "content-security-policy",
        "default-src 'none'; style-src 'unsafe-inline'; img-src data:",
    ),
    ("x-content-type-options", "nosniff"),
];

const TEMPLATES: [(&str, &str); 9] = [
    ("base.html", include_str!("../templates/base.html")),
    ("sessions.html", include_str!("../templates/sessions.html")),
    ("groups.html", include_str!("../templates/groups.html")),
    ("group.html", include_str!("../templates/group.html")),
    ("session.html", include_str!("../templates/session.html")),
    ("sample.html", include_str!("../templates/sample.html")),
    ("run.html", include_str!("../templates/run.html")),
    ("samples.html", include_str!("../templates/samples.html")),
    ("login.html", include_str!("../templates/login.html")),
];

const DEFAULT_PER_PAGE: usize = 50;
const MAX_PER_PAGE: usize = 500;
/// Calls on one page of a session (`?page=N`; `per` up to [`MAX_CALLS_PER_PAGE`]).
pub const CALLS_PER_PAGE: usize = 200;
const MAX_CALLS_PER_PAGE: usize = 1000;

/// One samples file the viewer knows, by the name its pages use (`file=NAME`).
#[derive(Debug, Clone)]
struct SamplesFile {
    name: String,
    path: PathBuf,
    /// Where it was found: "--samples", "data dir", "run".
    source: &'static str,
}

/// What the list pages show of one sample (the tokens stay in the file).
#[derive(Debug, Clone)]
struct SampleRow {
    id: String,
    session: String,
    group: Option<String>,
    reward: Option<f64>,
    tokens: usize,
    trained: usize,
    fork_reason: Option<String>,
    /// `main` or `side`.
    thread: String,
}

/// Sample rows per file, kept while the file's modification time and length stay the same.
type RowCache = HashMap<PathBuf, (Option<SystemTime>, u64, Arc<Vec<SampleRow>>)>;

/// The rewards posted for a session's calls: by call id, and by seq.
type CallRewards = (HashMap<String, f64>, HashMap<u64, f64>);

/// The viewer over one data dir (and optionally one `graft rl` output dir).
pub struct Viewer {
    data_dir: PathBuf,
    run_dir: Option<PathBuf>,
    /// Prefix of every link: "" for `graft view`, "/ui" under the gateway.
    base: String,
    tokenizer: Option<Tokenizer>,
    env: Environment<'static>,
    /// Samples files named on the command line (`graft view --samples FILE`).
    samples: Vec<SamplesFile>,
    rows: Mutex<RowCache>,
    /// Served behind a [`login::Login`]: pages show a log-out button.
    keyed: bool,
}

fn q(s: &str) -> String {
    form_urlencoded::byte_serialize(s.as_bytes()).collect()
}

fn fmt_time(us: i64) -> String {
    let secs = us.div_euclid(1_000_000);
    let (d, rem) = (secs.div_euclid(86_400), secs.rem_euclid(86_400));
    // Civil date from days since the epoch (Howard Hinnant's algorithm).
    let z = d + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02} {:02}:{:02}:{:02}",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}

/// Filters of the sessions page, from its query string.
#[derive(Debug, Default, Clone)]
struct Filters {
    group: Option<String>,
    outcome: Option<String>,
    reward_min: Option<f64>,
    reward_max: Option<f64>,
    closed: Option<bool>,
    /// The harness `graft rl` named for the session, or (for a session that names none) a
    /// part of its first call's `User-Agent`, case-insensitive.
    harness: Option<String>,
    /// A weight version that answered one of its calls.
    weight: Option<String>,
    page: usize,
    per: usize,
}

fn parse_query(query: &str) -> BTreeMap<String, String> {
    form_urlencoded::parse(query.as_bytes())
        .filter(|(_, v)| !v.is_empty())
        .map(|(k, v)| (k.into_owned(), v.into_owned()))
        .collect()
}

impl Filters {
    fn parse(query: &str) -> Result<Filters, ViewError> {
        let m = parse_query(query);
        let num = |k: &str| -> Result<Option<f64>, ViewError> {
            m.get(k)
                .map(|v| {
                    v.parse::<f64>().map_err(|_| {
                        ViewError::BadQuery(format!("{k} must be a number, got '{v}'"))
                    })
                })
                .transpose()
        };
        let (page, per) = paging(&m)?;
        let outcome = m.get("outcome").cloned();
        if let Some(o) = &outcome
            && o != graft_recorder::CallOutcome::Ok.as_str()
            && o != "errors"
        {
            return Err(ViewError::BadQuery(format!(
                "outcome must be 'ok' or 'errors', got '{o}'"
            )));
        }
        let closed = match m.get("closed").map(String::as_str) {
            None => None,
            Some("yes") => Some(true),
            Some("no") => Some(false),
            Some(o) => {
                return Err(ViewError::BadQuery(format!(
                    "closed must be 'yes' or 'no', got '{o}'"
                )));
            }
        };
        Ok(Filters {
            group: m.get("group").cloned(),
            outcome,
            reward_min: num("reward_min")?,
            reward_max: num("reward_max")?,
            closed,
            harness: m.get("harness").cloned(),
            weight: m.get("weight").cloned(),
            page,
            per,
        })
    }

    fn matches(&self, s: &SessionSummary) -> bool {
        self.group
            .as_ref()
            .is_none_or(|g| s.group_id.as_ref() == Some(g))
            && self.outcome.as_deref().is_none_or(|o| match o {
                "ok" => s.errors == 0,
                _ => s.errors > 0,
            })
            && self
                .reward_min
                .is_none_or(|m| s.reward.is_some_and(|r| r >= m))
            && self
                .reward_max
                .is_none_or(|m| s.reward.is_some_and(|r| r <= m))
            && self.closed.is_none_or(|c| s.closed == c)
            && self.harness.as_deref().is_none_or(|h| match &s.harness {
                Some(named) => named.eq_ignore_ascii_case(h),
                None => s
                    .client
                    .as_deref()
                    .is_some_and(|c| c.to_ascii_lowercase().contains(&h.to_ascii_lowercase())),
            })
            && self
                .weight
                .as_ref()
                .is_none_or(|w| s.weight_versions.contains(w))
    }

    /// The query string of these filters on page `page`.
    fn query(&self, page: usize) -> String {
        let mut ser = form_urlencoded::Serializer::new(String::new());
        if let Some(g) = &self.group {
            ser.append_pair("group", g);
        }
        if let Some(o) = &self.outcome {
            ser.append_pair("outcome", o);
        }
        if let Some(v) = self.reward_min {
            ser.append_pair("reward_min", &v.to_string());
        }
        if let Some(v) = self.reward_max {
            ser.append_pair("reward_max", &v.to_string());
        }
        if let Some(c) = self.closed {
            ser.append_pair("closed", if c { "yes" } else { "no" });
        }
        if let Some(h) = &self.harness {
            ser.append_pair("harness", h);
        }
        if let Some(w) = &self.weight {
            ser.append_pair("weight", w);
        }
        ser.append_pair("per", &self.per.to_string());
        ser.append_pair("page", &page.to_string());
        ser.finish()
    }
}

fn session_row(s: &SessionSummary) -> Value {
    json!({
        "id": s.session_id, "id_q": q(&s.session_id),
        "group": s.group_id, "group_q": s.group_id.as_deref().map(q),
        "calls": s.calls, "errors": s.errors, "reward": s.reward, "closed": s.closed,
        "first": fmt_time(s.first_us),
        "harness": s.harness.as_deref().or(s.client.as_deref()),
        "weights": s.weight_versions.join(", "),
    })
}

/// `page` and `per` of a paged list page, from its query string.
fn paging(m: &BTreeMap<String, String>) -> Result<(usize, usize), ViewError> {
    let int = |k: &str, d: usize| -> Result<usize, ViewError> {
        m.get(k).map_or(Ok(d), |v| {
            v.parse::<usize>()
                .map_err(|_| ViewError::BadQuery(format!("{k} must be a whole number, got '{v}'")))
        })
    };
    Ok((
        int("page", 1)?.max(1),
        int("per", DEFAULT_PER_PAGE)?.clamp(1, MAX_PER_PAGE),
    ))
}

impl Viewer {
    /// `tokenizer_dir`: a model dir whose `tokenizer.json` turns sample tokens into text
    /// (without one, the sample page shows token ids).
    pub fn new(
        data_dir: &Path,
        run_dir: Option<&Path>,
        tokenizer_dir: Option<&Path>,
        base: &str,
    ) -> Result<Viewer, ViewError> {
        let mut env = Environment::new();
        for (name, src) in TEMPLATES {
            env.add_template(name, src)
                .map_err(|e| ViewError::Template {
                    name: name.to_owned(),
                    message: e.to_string(),
                })?;
        }
        let tokenizer = tokenizer_dir
            .map(|d| {
                Tokenizer::from_dir(d).map_err(|e| ViewError::Read {
                    path: d.join("tokenizer.json"),
                    message: e.to_string(),
                })
            })
            .transpose()?;
        Ok(Viewer {
            data_dir: data_dir.to_path_buf(),
            run_dir: run_dir.map(Path::to_path_buf),
            base: base.trim_end_matches('/').to_owned(),
            tokenizer,
            env,
            samples: Vec::new(),
            rows: Mutex::new(HashMap::new()),
            keyed: false,
        })
    }

    /// Marks the viewer as served behind a [`login::Login`] (its pages then offer a log-out).
    pub fn keyed(mut self, keyed: bool) -> Viewer {
        self.keyed = keyed;
        self
    }

    /// Adds samples files (written by `graft reconstruct --out FILE`), shown by their file
    /// names. Each must be a file, and no two may share a name.
    pub fn with_samples(mut self, files: &[PathBuf]) -> Result<Viewer, ViewError> {
        for path in files {
            if !path.is_file() {
                return Err(ViewError::Read {
                    path: path.clone(),
                    message: "no such samples file (graft reconstruct --out FILE writes one)"
                        .into(),
                });
            }
            let name = path
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_default();
            if self.samples.iter().any(|f| f.name == name) {
                return Err(ViewError::Read {
                    path: path.clone(),
                    message: format!(
                        "another samples file given is also named '{name}'; pages name samples files by file name, so rename one"
                    ),
                });
            }
            self.samples.push(SamplesFile {
                name,
                path: path.clone(),
                source: "--samples",
            });
        }
        Ok(self)
    }

    /// Answers `GET {base}{path}?{query}` (`path` without the base). Errors are pages too.
    pub fn page(&self, path: &str, query: &str) -> Page {
        let path = if path.is_empty() { "/" } else { path };
        let result = match path {
            "/" | "/sessions" => self.sessions(query),
            "/groups" => self.groups(query),
            "/run" => self.run(),
            "/sample" => self.sample(query),
            "/samples" => self.samples_page(query),
            p => match (p.strip_prefix("/session/"), p.strip_prefix("/group/")) {
                (Some(id), _) => id_in_path("session", id).and_then(|id| self.session(&id, query)),
                (_, Some(id)) => id_in_path("group", id).and_then(|id| self.group(&id)),
                _ => Err(ViewError::NotFound(format!("no page at '{path}'"))),
            },
        };
        match result {
            Ok(body) => Page {
                status: 200,
                content_type: "text/html; charset=utf-8",
                body,
            },
            Err(e) => self.error_page(e.status(), &e.to_string()),
        }
    }

    /// An error as a page of the viewer (what its server answers when it refuses a request
    /// itself: no admin key, a method other than GET), so a browser shows the reason.
    pub fn error_page(&self, status: u16, message: &str) -> Page {
        Page {
            status,
            content_type: "text/html; charset=utf-8",
            body: self
                .render("base.html", json!({"title": "error", "error": message}))
                .unwrap_or_else(|_| message.to_owned()),
        }
    }

    /// The login page of a keyed viewer (status 401): a form that posts the admin key to
    /// `{base}/login`, then goes back to `next` (a path of this server). `message` says why
    /// it is shown (no key yet, a wrong one); the key itself is never on it.
    pub fn login_page(&self, message: &str, next: &str) -> Page {
        Page {
            status: 401,
            content_type: "text/html; charset=utf-8",
            body: self
                .render(
                    "login.html",
                    json!({"title": "log in", "error": message, "login": true,
                           "next": login::safe_next(next)}),
                )
                .unwrap_or_else(|_| message.to_owned()),
        }
    }

    /// The run page as one self-contained HTML file (`graft rl` writes it as `report.html`).
    pub fn run_report(&self) -> Result<String, ViewError> {
        self.run()
    }

    fn render(&self, name: &str, mut ctx: Value) -> Result<String, ViewError> {
        if let Some(o) = ctx.as_object_mut() {
            o.insert("base".into(), json!(self.base));
            o.insert("has_run".into(), json!(self.run_dir.is_some()));
            o.insert("keyed".into(), json!(self.keyed));
        }
        self.env
            .get_template(name)
            .and_then(|t| t.render(minijinja::Value::from(minijinja::value::Serde(&ctx))))
            .map_err(|e| ViewError::Template {
                name: name.to_owned(),
                message: format!("{e:#}"),
            })
    }

    fn summaries(&self) -> Result<Vec<SessionSummary>, ViewError> {
        graft_recorder::list_sessions(&self.data_dir).map_err(|source| ViewError::Records {
            dir: self.data_dir.clone(),
            source,
        })
    }

    fn sessions(&self, query: &str) -> Result<String, ViewError> {
        let f = Filters::parse(query)?;
        let all = self.summaries()?;
        let matched: Vec<&SessionSummary> = all.iter().filter(|s| f.matches(s)).collect();
        let pages = matched.len().div_ceil(f.per).max(1);
        let page = f.page.min(pages);
        let rows: Vec<Value> = matched
            .iter()
            .skip((page - 1) * f.per)
            .take(f.per)
            .map(|s| session_row(s))
            .collect();
        self.render(
            "sessions.html",
            json!({
                "title": "sessions",
                "total": all.len(), "matched": matched.len(), "shown": rows.len(),
                "page": page, "pages": pages, "rows": rows,
                "prev": (page > 1).then(|| f.query(page - 1)),
                "next": (page < pages).then(|| f.query(page + 1)),
                "f": {"group": f.group, "outcome": f.outcome, "reward_min": f.reward_min,
                      "reward_max": f.reward_max, "closed": f.closed.map(|c| if c { "yes" } else { "no" }),
                      "harness": f.harness, "weight": f.weight, "per": f.per},
            }),
        )
    }

    fn groups(&self, query: &str) -> Result<String, ViewError> {
        let (page, per) = paging(&parse_query(query))?;
        let mut by: BTreeMap<String, (usize, Vec<f64>, u64)> = BTreeMap::new();
        for s in self.summaries()? {
            let Some(g) = s.group_id else { continue };
            let e = by.entry(g).or_default();
            e.0 += 1;
            e.1.extend(s.reward);
            e.2 += s.errors;
        }
        let pages = by.len().div_ceil(per).max(1);
        let page = page.min(pages);
        let link = |p: usize| format!("per={per}&page={p}");
        let rows: Vec<Value> = by
            .iter()
            .skip((page - 1) * per)
            .take(per)
            .map(|(g, (n, rewards, errors))| {
                let mean = (!rewards.is_empty())
                    .then(|| rewards.iter().sum::<f64>() / rewards.len() as f64);
                json!({"group": g, "group_q": q(g), "sessions": n, "rewarded": rewards.len(),
                       "mean": mean, "best": rewards.iter().copied().reduce(f64::max), "errors": errors})
            })
            .collect();
        self.render(
            "groups.html",
            json!({"title": "groups", "total": by.len(), "shown": rows.len(), "rows": rows,
                   "page": page, "pages": pages,
                   "prev": (page > 1).then(|| link(page - 1)),
                   "next": (page < pages).then(|| link(page + 1))}),
        )
    }

    /// Records of one session, in seq order: only that session's rows are read.
    fn session_records(&self, id: &str) -> Result<Vec<CallRecord>, ViewError> {
        graft_recorder::read_session(&self.data_dir, id).map_err(|source| ViewError::Records {
            dir: self.data_dir.clone(),
            source,
        })
    }

    /// The rewards posted for a session's calls (`call_reward` events), by call id and by
    /// seq; the last one posted for a call counts.
    fn call_rewards(&self, id: &str) -> Result<CallRewards, ViewError> {
        let events = graft_recorder::read_session_events(&self.data_dir).map_err(|source| {
            ViewError::Records {
                dir: self.data_dir.clone(),
                source,
            }
        })?;
        let (mut by_id, mut by_seq) = (HashMap::new(), HashMap::new());
        for e in events {
            if let graft_recorder::SessionEvent::CallReward {
                session_id,
                call_id,
                seq,
                reward,
                ..
            } = e
                && session_id == id
            {
                if let Some(c) = call_id {
                    by_id.insert(c, reward);
                }
                if let Some(n) = seq {
                    by_seq.insert(n, reward);
                }
            }
        }
        Ok((by_id, by_seq))
    }

    /// One session's calls as the conversation, [`CALLS_PER_PAGE`] calls a page
    /// (`?page=N`, `per=M`), with its samples linked.
    fn session(&self, id: &str, query: &str) -> Result<String, ViewError> {
        let m = parse_query(query);
        let int = |k: &str, d: usize| -> Result<usize, ViewError> {
            m.get(k).map_or(Ok(d), |v| match v.parse::<usize>() {
                Ok(n) if n >= 1 => Ok(n),
                _ => Err(ViewError::BadQuery(format!(
                    "{k} must be a whole number from 1, got '{v}'"
                ))),
            })
        };
        let (page, per) = (
            int("page", 1)?,
            int("per", CALLS_PER_PAGE)?.min(MAX_CALLS_PER_PAGE),
        );
        let summary = self.summaries()?.into_iter().find(|s| s.session_id == id);
        let Some(summary) = summary else {
            return Err(ViewError::NotFound(format!(
                "no session '{id}' in {}",
                self.data_dir.display()
            )));
        };
        let recs = self.session_records(id)?;
        let pages = recs.len().div_ceil(per).max(1);
        if page > pages {
            return Err(ViewError::NotFound(format!(
                "session '{id}' has {} calls, {pages} page(s) of {per}: there is no page {page}",
                recs.len()
            )));
        }
        let from = (page - 1) * per;
        let (reward_by_id, reward_by_seq) = self.call_rewards(id)?;
        // What the call before this page had shown, so its first call shows only what it added.
        let mut seen = from.checked_sub(1).map_or(0, |i| {
            let r = &recs[i];
            conversation::request_messages(r.normalized_request.as_ref(), &r.request).len()
                + usize::from(
                    conversation::answer(r.normalized_response.as_ref(), r.response.as_ref())
                        .is_some(),
                )
        });
        let calls: Vec<Value> = recs
            .iter()
            .skip(from)
            .take(per)
            .map(|r| {
                let msgs =
                    conversation::request_messages(r.normalized_request.as_ref(), &r.request);
                // Only what this call added to the conversation (a harness resends it all).
                let new = if msgs.len() >= seen {
                    msgs[seen..].to_vec()
                } else {
                    msgs.clone()
                };
                let answer =
                    conversation::answer(r.normalized_response.as_ref(), r.response.as_ref());
                seen = msgs.len() + usize::from(answer.is_some());
                let reward = reward_by_id
                    .get(&r.call_id)
                    .or_else(|| reward_by_seq.get(&r.seq))
                    .copied();
                json!({
                    "seq": r.seq, "call_id": r.call_id, "status": r.status, "outcome": r.outcome,
                    "error": r.error, "latency_ms": r.latency_ms, "ttft_ms": r.ttft_ms,
                    "model": r.model, "client": r.client, "dialect": r.dialect, "stream": r.stream,
                    "weight_version": r.weight_version,
                    "finish_reason": r.finish_reason,
                    "backend_finish_reason": r.backend_finish_reason.as_ref().filter(|b| Some(*b) != r.finish_reason.as_ref()),
                    "reward": reward,
                    "prompt_tokens": r.usage.as_ref().and_then(|u| u.prompt_tokens),
                    "completion_tokens": r.usage.as_ref().and_then(|u| u.completion_tokens),
                    "started": fmt_time(r.started_at_us),
                    "messages": new, "answer": answer,
                })
            })
            .collect();
        let (samples, unreadable) = self.samples_of(Some(id), summary.group_id.as_deref())?;
        let link = |p: usize| {
            if per == CALLS_PER_PAGE {
                format!("page={p}")
            } else {
                format!("per={per}&page={p}")
            }
        };
        self.render(
            "session.html",
            json!({"title": format!("session {id}"), "s": session_row(&summary), "calls": calls,
                   "recorded": recs.len(), "page": page, "pages": pages,
                   "first_call": (!calls.is_empty()).then_some(from + 1),
                   "last_call": from + calls.len(),
                   "first": (page > 1).then(|| link(1)),
                   "prev": (page > 1).then(|| link(page - 1)),
                   "next": (page < pages).then(|| link(page + 1)),
                   "last": (page < pages).then(|| link(pages)),
                   "samples": samples, "unreadable": unreadable}),
        )
    }

    fn steps(&self) -> Result<Vec<Value>, ViewError> {
        let Some(run) = &self.run_dir else {
            return Err(ViewError::NotFound(
                "no RL run given: start the viewer with --run OUT_DIR".into(),
            ));
        };
        let path = run.join("steps.jsonl");
        let text = std::fs::read_to_string(&path).map_err(|e| match e.kind() {
            std::io::ErrorKind::NotFound => ViewError::NotFound(format!(
                "{} has no steps.jsonl: no step of the run has finished yet, or it is not a graft rl output dir",
                run.display()
            )),
            _ => ViewError::Read {
                path: path.clone(),
                message: e.to_string(),
            },
        })?;
        text.lines()
            .filter(|l| !l.trim().is_empty())
            .enumerate()
            .map(|(i, l)| {
                serde_json::from_str(l).map_err(|e| ViewError::Read {
                    path: path.clone(),
                    message: format!("line {}: {e}", i + 1),
                })
            })
            .collect()
    }

    fn group(&self, id: &str) -> Result<String, ViewError> {
        let sessions: Vec<Value> = self
            .summaries()?
            .iter()
            .filter(|s| s.group_id.as_deref() == Some(id))
            .map(session_row)
            .collect();
        if sessions.is_empty() {
            return Err(ViewError::NotFound(format!("no group '{id}'")));
        }
        // The BAR decision, when an RL run made this group.
        let mut decision = Value::Null;
        if self.run_dir.is_some() {
            for step in self.steps()? {
                let Some(g) = step["groups"]
                    .as_array()
                    .and_then(|gs| gs.iter().find(|g| g["group"] == id))
                else {
                    continue;
                };
                decision = json!({"step": step["step"], "rollouts": g["rollouts"],
                    "selected": g["selected"], "decision": g["decision"].to_string()});
            }
        }
        // Its samples: from the run's step that trained it and any samples file given.
        let (samples, unreadable) = self.samples_of(None, Some(id))?;
        self.render(
            "group.html",
            json!({"title": format!("group {id}"), "group": id, "sessions": sessions,
                   "decision": decision, "samples": samples, "unreadable": unreadable}),
        )
    }

    /// Every samples file the viewer can show, found afresh on each call (a reconstruct or
    /// an RL step may have written one since): those given with `--samples`, then the
    /// `*.parquet` files at the top of the data dir and in its `samples/` folder (where a
    /// user keeps `graft reconstruct --out` beside the records it came from; the recorder's
    /// own Parquet lives under `records/`), then the run's `samples/`. A name seen twice is
    /// the first one's.
    fn samples_files(&self) -> Vec<SamplesFile> {
        let mut files = self.samples.clone();
        let mut folders = vec![
            (self.data_dir.clone(), "data dir"),
            (self.data_dir.join("samples"), "data dir"),
        ];
        if let Some(run) = &self.run_dir {
            folders.push((run.join("samples"), "run"));
        }
        for (dir, source) in folders {
            let Ok(entries) = std::fs::read_dir(&dir) else {
                continue;
            };
            let mut found: Vec<SamplesFile> = entries
                .flatten()
                .filter_map(|e| {
                    let name = e.file_name().into_string().ok()?;
                    let path = e.path();
                    (name.ends_with(".parquet") && !name.starts_with('.') && path.is_file())
                        .then_some(SamplesFile { name, path, source })
                })
                .collect();
            found.sort_by(|a, b| a.name.cmp(&b.name));
            for f in found {
                if !files.iter().any(|g| g.name == f.name) {
                    files.push(f);
                }
            }
        }
        files
    }

    /// The samples file a page names (`file=NAME`): a plain file name, never a path.
    fn samples_file(&self, file: &str) -> Result<SamplesFile, ViewError> {
        if file.is_empty()
            || file.contains('/')
            || file.contains('\\')
            || file.starts_with('.')
            || file.chars().any(char::is_control)
        {
            return Err(ViewError::BadQuery(format!(
                "file must name a samples file (a file name, no folder), got '{}'",
                file.escape_debug()
            )));
        }
        self.samples_files()
            .into_iter()
            .find(|f| f.name == file)
            .ok_or_else(|| {
                ViewError::NotFound(format!(
                    "no samples file '{file}': the viewer shows the files given with --samples, the *.parquet files in {} and its samples/ folder{}",
                    self.data_dir.display(),
                    match &self.run_dir {
                        Some(run) => format!(", and {}", run.join("samples").display()),
                        None => String::new(),
                    }
                ))
            })
    }

    fn read_samples(&self, file: &str) -> Result<Vec<Sample>, ViewError> {
        let f = self.samples_file(file)?;
        read_samples_at(&f.path)
    }

    /// The list rows of one samples file, read once per version of the file.
    fn sample_rows(&self, path: &Path) -> Result<Arc<Vec<SampleRow>>, ViewError> {
        let meta = std::fs::metadata(path).map_err(|e| match e.kind() {
            std::io::ErrorKind::NotFound => {
                ViewError::NotFound(format!("{} is gone", path.display()))
            }
            _ => ViewError::Read {
                path: path.to_path_buf(),
                message: e.to_string(),
            },
        })?;
        let stamp = (meta.modified().ok(), meta.len());
        if let Ok(cache) = self.rows.lock()
            && let Some((m, l, rows)) = cache.get(path)
            && (*m, *l) == stamp
        {
            return Ok(Arc::clone(rows));
        }
        let rows: Arc<Vec<SampleRow>> = Arc::new(
            read_samples_at(path)?
                .iter()
                .map(|s| SampleRow {
                    id: s.sample_id.clone(),
                    session: s.session_id.clone(),
                    group: s.group_id.clone(),
                    reward: s.reward,
                    tokens: s.tokens.len(),
                    trained: s.trained_tokens(),
                    fork_reason: s.fork_reason.clone(),
                    thread: s.thread.clone(),
                })
                .collect(),
        );
        if let Ok(mut cache) = self.rows.lock() {
            cache.insert(path.to_path_buf(), (stamp.0, stamp.1, Arc::clone(&rows)));
        }
        Ok(rows)
    }

    /// The samples of one session (or one group) in every samples file that may hold them:
    /// the files given or found in the data dir, and the run's step files whose step
    /// trained that group (not every step's file). A file that cannot be read is named in
    /// the second list.
    fn samples_of(
        &self,
        session: Option<&str>,
        group: Option<&str>,
    ) -> Result<(Vec<Value>, Vec<String>), ViewError> {
        let mut run_files: Vec<String> = vec![];
        if let (Some(g), Some(_)) = (group, &self.run_dir)
            && let Ok(steps) = self.steps()
        {
            for step in steps {
                let trained_here = step["groups"]
                    .as_array()
                    .is_some_and(|gs| gs.iter().any(|x| x["group"] == g));
                if let (true, Some(file)) = (trained_here, step["samples_file"].as_str())
                    && let Some(name) = Path::new(file).file_name()
                {
                    run_files.push(name.to_string_lossy().into_owned());
                }
            }
        }
        let mut out = vec![];
        let mut unreadable = vec![];
        for f in self.samples_files() {
            if f.source == "run" && !run_files.contains(&f.name) {
                continue;
            }
            let rows = match self.sample_rows(&f.path) {
                Ok(rows) => rows,
                Err(e) => {
                    unreadable.push(format!("{}: {e}", f.name));
                    continue;
                }
            };
            out.extend(
                rows.iter()
                    .filter(|r| session.is_none_or(|s| r.session == s))
                    .filter(|r| group.is_none_or(|g| r.group.as_deref() == Some(g)))
                    .map(|r| sample_row_json(&f.name, r)),
            );
        }
        Ok((out, unreadable))
    }

    /// `/samples`: the samples files the viewer knows; `/samples?file=NAME`: that file's
    /// samples, paged.
    fn samples_page(&self, query: &str) -> Result<String, ViewError> {
        let m = parse_query(query);
        let (page, per) = paging(&m)?;
        let Some(file) = m.get("file") else {
            let files: Vec<Value> = self
                .samples_files()
                .iter()
                .map(|f| {
                    json!({"name": f.name, "q": q(&f.name), "source": f.source,
                           "bytes": std::fs::metadata(&f.path).map(|m| m.len()).ok()})
                })
                .collect();
            return self.render(
                "samples.html",
                json!({"title": "samples", "files": files, "data_dir": self.data_dir.display().to_string()}),
            );
        };
        let f = self.samples_file(file)?;
        let rows = self.sample_rows(&f.path)?;
        let pages = rows.len().div_ceil(per).max(1);
        let page = page.min(pages);
        let shown: Vec<Value> = rows
            .iter()
            .skip((page - 1) * per)
            .take(per)
            .map(|r| sample_row_json(&f.name, r))
            .collect();
        let link = |p: usize| format!("file={}&per={per}&page={p}", q(&f.name));
        self.render(
            "samples.html",
            json!({"title": format!("samples in {}", f.name), "file": f.name, "source": f.source,
                   "total": rows.len(), "rows": shown, "page": page, "pages": pages,
                   "prev": (page > 1).then(|| link(page - 1)),
                   "next": (page < pages).then(|| link(page + 1))}),
        )
    }

    fn sample(&self, query: &str) -> Result<String, ViewError> {
        let m = parse_query(query);
        let (Some(file), Some(id)) = (m.get("file"), m.get("id")) else {
            return Err(ViewError::BadQuery(
                "a sample is named by file=FILE.parquet&id=SESSION/N (the samples page lists them)"
                    .into(),
            ));
        };
        let s = self
            .read_samples(file)?
            .into_iter()
            .find(|s| &s.sample_id == id)
            .ok_or_else(|| ViewError::NotFound(format!("no sample '{id}' in {file}")))?;
        let events: Vec<Value> = s
            .events
            .iter()
            .enumerate()
            .map(|(n, e)| {
                json!({
                    "n": n, "kind": e.kind.as_str(), "at": e.at, "len": e.len, "reason": e.reason,
                    "call": e.call_id, "other": e.other_sample,
                    "other_q": e.other_sample.as_deref().map(q),
                })
            })
            .collect();
        let events_at = |i: usize| -> Vec<Value> {
            s.events
                .iter()
                .zip(&events)
                .filter(|(e, _)| e.at as usize == i)
                .map(|(_, v)| v.clone())
                .collect()
        };
        let mut tokens: Vec<Value> = s
            .tokens
            .iter()
            .enumerate()
            .map(|(i, &t)| {
                let text = match &self.tokenizer {
                    Some(tk) => tk.decode(&[t]).unwrap_or_else(|_| format!("#{t}")),
                    None => format!("#{t} "),
                };
                let lp = s.logprobs.get(i).copied().flatten();
                let wv = s
                    .token_weight_versions
                    .get(i)
                    .copied()
                    .flatten()
                    .and_then(|v| s.weight_versions.get(v as usize).cloned());
                json!({
                    "i": i, "id": t, "text": text,
                    "trained": s.loss_mask.get(i) == Some(&1),
                    "logprob": lp,
                    // Heat: the sampled token's probability, 0 (red) .. 1 (green).
                    "hue": lp.map(|l| (f64::from(l).exp().clamp(0.0, 1.0) * 120.0).round() as i64),
                    "weight_version": wv,
                    "call_reward": s.token_call_reward(i),
                    "events": events_at(i),
                })
            })
            .collect();
        // Events past the last token (a fork at a sample's very end) close the list.
        let tail: Vec<Value> = s
            .events
            .iter()
            .zip(&events)
            .filter(|(e, _)| e.at as usize >= s.tokens.len())
            .map(|(_, v)| v.clone())
            .collect();
        if !tail.is_empty() {
            tokens.push(json!({"end": true, "events": tail}));
        }
        let trained = s.trained_tokens();
        self.render(
            "sample.html",
            json!({"title": format!("sample {id}"), "s": {
                "id": s.sample_id, "session": s.session_id, "session_q": q(&s.session_id),
                "group": s.group_id, "group_q": s.group_id.as_deref().map(q),
                "reward": s.reward, "fork_reason": s.fork_reason, "calls": s.call_ids.len(),
                "weight_versions": s.weight_versions, "tokens": s.tokens.len(), "trained": trained,
                "decoded": self.tokenizer.is_some(), "file_q": q(file), "file": file,
                "call_rewards": s.call_ids.iter().zip(&s.call_rewards)
                    .filter_map(|(c, r)| r.map(|r| json!({"call": c, "reward": r})))
                    .collect::<Vec<_>>(),
                "thread": s.thread, "thread_id": s.thread_id, "thread_name": s.thread_name,
                "parent": s.parent_sample, "parent_q": s.parent_sample.as_deref().map(q),
            }, "tokens": tokens, "events": events,
            "rewrites": s.rewrites.iter().map(|r| json!({
                "kind": r.kind.as_str(), "call": r.call_id, "against": r.against_call,
                "message": r.message, "role": r.role, "before": r.before, "after": r.after,
            })).collect::<Vec<_>>()}),
        )
    }

    fn run(&self) -> Result<String, ViewError> {
        let steps = self.steps()?;
        let x: Vec<f64> = steps
            .iter()
            .enumerate()
            .map(|(i, s)| s["step"].as_f64().unwrap_or(i as f64))
            .collect();
        let rewards = |s: &Value| -> Vec<f64> {
            s["rollout_list"]
                .as_array()
                .map(|rs| rs.iter().filter_map(|r| r["reward"].as_f64()).collect())
                .unwrap_or_default()
        };
        let reward = svg::line_chart(
            "reward: mean, and min–max over the step's rollouts",
            "step",
            &[svg::Series {
                name: "reward mean",
                points: x
                    .iter()
                    .zip(&steps)
                    .map(|(x, s)| (*x, s["reward_mean"].as_f64()))
                    .collect(),
                band: Some(
                    steps
                        .iter()
                        .map(|s| {
                            let r = rewards(s);
                            let lo = r.iter().copied().reduce(f64::min)?;
                            let hi = r.iter().copied().reduce(f64::max)?;
                            Some((lo, hi))
                        })
                        .collect(),
                ),
            }],
        );
        let trained = svg::line_chart(
            "trained tokens (loss mask 1)",
            "step",
            &[svg::Series {
                name: "trained tokens",
                points: x
                    .iter()
                    .zip(&steps)
                    .map(|(x, s)| (*x, s["trained_tokens"].as_f64()))
                    .collect(),
                band: None,
            }],
        );
        let phases = ["rollout", "reconstruct", "train", "push"];
        let phase_layers: Vec<(&str, Vec<f64>)> = phases
            .iter()
            .map(|p| {
                (
                    *p,
                    steps
                        .iter()
                        .map(|s| s["secs"][p].as_f64().unwrap_or(0.0))
                        .collect(),
                )
            })
            .collect();
        let phase_chart = svg::stacked_bars("phase seconds", "step", &x, &phase_layers);
        let mut versions: Vec<String> = vec![];
        for s in &steps {
            if let Some(m) = s["call_weight_versions"].as_object() {
                for k in m.keys() {
                    if !versions.contains(k) {
                        versions.push(k.clone());
                    }
                }
            }
        }
        let version_layers: Vec<(&str, Vec<f64>)> = versions
            .iter()
            .map(|v| {
                (
                    v.as_str(),
                    steps
                        .iter()
                        .map(|s| s["call_weight_versions"][v].as_f64().unwrap_or(0.0))
                        .collect(),
                )
            })
            .collect();
        let version_chart =
            svg::stacked_bars("calls per weight version", "step", &x, &version_layers);
        // Staleness: calls of a step answered by weights other than the step's newest. A
        // step that names no weights (nothing pushed yet) has no staleness to show.
        let stale: Vec<Value> = steps
            .iter()
            .map(|s| {
                let counts = s["call_weight_versions"].as_object();
                let total: u64 = counts
                    .map(|m| m.values().filter_map(Value::as_u64).sum())
                    .unwrap_or(0);
                let other = s["weight_version"].as_str().map(|w| {
                    total.saturating_sub(counts.and_then(|m| m.get(w)?.as_u64()).unwrap_or(0))
                });
                json!({"step": s["step"], "calls": total, "other_versions": other})
            })
            .collect();
        let rows: Vec<Value> = steps
            .iter()
            .zip(&stale)
            .map(|(s, st)| {
                let groups: Vec<Value> = s["groups"]
                    .as_array()
                    .map(|gs| {
                        gs.iter()
                            .filter_map(|g| g["group"].as_str())
                            .map(|g| json!({"name": g, "q": q(g)}))
                            .collect()
                    })
                    .unwrap_or_default();
                json!({"step": s["step"], "rollouts": s["rollouts"], "scored": s["scored"],
                   "reward_mean": s["reward_mean"], "samples": s["samples"],
                   "trained_tokens": s["trained_tokens"], "weight_version": s["weight_version"],
                   "secs": s["secs"]["step"], "groups": groups, "other_versions": st["other_versions"]})
            })
            .collect();
        self.render(
            "run.html",
            json!({"title": "RL run", "steps": steps.len(), "rows": rows,
                   "charts": [reward, trained, phase_chart, version_chart]}),
        )
    }
}

fn decode(s: &str) -> String {
    percent_decode(s)
}

/// A session or group id from a page's path: decoded, and refused (400) when it holds a
/// control character (no recorded id does).
fn id_in_path(what: &str, raw: &str) -> Result<String, ViewError> {
    let id = decode(raw);
    if id.chars().any(char::is_control) {
        return Err(ViewError::BadQuery(format!(
            "a {what} id has no control characters, got '{}'",
            id.escape_debug()
        )));
    }
    Ok(id)
}

fn read_samples_at(path: &Path) -> Result<Vec<Sample>, ViewError> {
    graft_reconstruct::sample::read_samples_parquet(path).map_err(|e| ViewError::BadFile {
        path: path.to_path_buf(),
        message: format!(
            "is not a samples file graft can read ({e}); it may be damaged, still being written, or another program's Parquet: `graft reconstruct --out FILE` writes one"
        ),
    })
}

fn sample_row_json(file: &str, r: &SampleRow) -> Value {
    json!({"id": r.id, "id_q": q(&r.id), "file": file, "file_q": q(file),
           "session": r.session, "session_q": q(&r.session), "group": r.group,
           "reward": r.reward, "tokens": r.tokens, "trained": r.trained,
           "fork_reason": r.fork_reason, "thread": r.thread})
}

/// `%XX` decoding of a path segment (invalid escapes are kept as they are).
fn percent_decode(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%'
            && i + 2 < b.len()
            && let Some(v) = std::str::from_utf8(&b[i + 1..i + 3])
                .ok()
                .and_then(|h| u8::from_str_radix(h, 16).ok())
        {
            out.push(v);
            i += 3;
            continue;
        }
        out.push(b[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

#[cfg(test)]
mod tests;
