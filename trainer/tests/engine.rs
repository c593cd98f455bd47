//! The serving engine: concurrent requests decoded as one batch compute what each would
//! alone; weights reload; pause with retract keeps in-flight requests (finished under the
//! new weights), pause with abort ends them.

use std::path::PathBuf;
use std::sync::mpsc::Receiver;

use graft_trainer::engine::{Engine, EngineFinish, Event, PauseMode, Request};
use graft_trainer::generate::{self, SamplingParams};
use graft_trainer::model::Model;
use graft_trainer::weights;
use tch::{Device, Kind, Tensor};

fn fixture() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/models/qwen3")
}

fn load(dir: &std::path::Path) -> anyhow::Result<Model> {
    graft_trainer::device::init();
    Ok(Model::load(dir, Device::Cpu, Kind::Float)?)
}

fn greedy(input: &[i64], n: usize) -> Request {
    Request {
        input_ids: input.to_vec(),
        params: SamplingParams {
            temperature: 0.0,
            max_new_tokens: n,
            ..SamplingParams::default()
        },
        ignore_eos: true,
    }
}

/// Collects a request's tokens, logprobs and final event.
fn collect(rx: &Receiver<Event>) -> anyhow::Result<(Vec<i64>, Vec<f32>, Event)> {
    let (mut ids, mut lps) = (Vec::new(), Vec::new());
    loop {
        match rx.recv()? {
            Event::Token { id, logprob, .. } => {
                ids.push(id);
                lps.push(logprob);
            }
            done => return Ok((ids, lps, done)),
        }
    }
}

/// A copy of the qwen3 fixture with every weight scaled, as the "new" weights.
fn perturbed(dir: &std::path::Path) -> anyhow::Result<()> {
    let m = load(&fixture())?;
    let params: Vec<(String, Tensor)> = m
        .named_parameters()
        .into_iter()
        .map(|(n, t)| (n, t.detach() * 1.3))
        .collect();
    weights::write_dir(dir, m.raw_config(), &params, Kind::Float, usize::MAX)?;
    Ok(())
}

#[test]
fn concurrent_requests_decode_as_one_batch_and_match_each_alone() -> anyhow::Result<()> {
    let model = load(&fixture())?;
    let engine = Engine::start(load(&fixture())?, "v0".to_owned(), 8)?;
    let prompts: Vec<Vec<i64>> = vec![
        vec![1, 5, 9],
        vec![2, 3, 4, 5, 6, 7, 8],
        vec![40, 41],
        vec![7; 5],
    ];
    // Hold the engine so all four are admitted together.
    engine.pause(PauseMode::InPlace)?;
    let lens = [6usize, 3, 8, 5];
    let rxs: Vec<_> = prompts
        .iter()
        .zip(lens)
        .map(|(p, n)| engine.generate(greedy(p, n)).map(|(_, rx)| rx))
        .collect::<Result<_, _>>()?;
    engine.resume()?;
    for ((p, n), rx) in prompts.iter().zip(lens).zip(&rxs) {
        let (ids, lps, done) = collect(rx)?;
        let alone = generate::sample(&model, std::slice::from_ref(p), n, 0.0)?;
        assert_eq!(ids, alone[0].tokens, "prompt {p:?}");
        for (a, b) in lps.iter().zip(&alone[0].logprobs) {
            assert!((a - b).abs() < 1e-4, "{a} vs {b}");
        }
        match done {
            Event::Done {
                finish,
                prompt_tokens,
                completion_tokens,
                weight_version,
            } => {
                assert_eq!(finish, EngineFinish::Length);
                assert_eq!((prompt_tokens, completion_tokens), (p.len(), n));
                assert_eq!(weight_version, "v0");
            }
            other => panic!("expected Done, got {other:?}"),
        }
    }
    let info = engine.info()?;
    assert_eq!(
        info.max_batch_seen, 4,
        "the four requests were not decoded together"
    );
    assert_eq!((info.running, info.waiting), (0, 0));
    Ok(())
}

#[test]
fn stop_tokens_and_max_new_tokens_end_requests() -> anyhow::Result<()> {
    let model = load(&fixture())?;
    let engine = Engine::start(load(&fixture())?, "v0".to_owned(), 4)?;
    let p = vec![3, 1, 4, 1, 5];
    let free = generate::sample(&model, std::slice::from_ref(&p), 6, 0.0)?;
    let stop = free[0].tokens[2];
    let mut req = greedy(&p, 6);
    req.params.stop_token_ids = vec![stop];
    let (_, rx) = engine.generate(req)?;
    let (ids, _, done) = collect(&rx)?;
    let first = free[0]
        .tokens
        .iter()
        .position(|&t| t == stop)
        .unwrap_or(usize::MAX);
    assert_eq!(ids, free[0].tokens[..=first]);
    assert!(
        matches!(done, Event::Done { finish: EngineFinish::Stop { matched }, .. } if matched == stop)
    );
    Ok(())
}

#[test]
fn weights_reload_changes_outputs_and_version() -> anyhow::Result<()> {
    let tmp = tempfile::tempdir()?;
    perturbed(tmp.path())?;
    let new_model = load(tmp.path())?;
    let engine = Engine::start(load(&fixture())?, "v0".to_owned(), 4)?;
    engine.update_weights(tmp.path().to_path_buf(), "v1".to_owned())?;
    assert_eq!(engine.info()?.weight_version, "v1");
    let p = vec![9, 8, 7];
    let (_, rx) = engine.generate(greedy(&p, 5))?;
    let (ids, _, done) = collect(&rx)?;
    assert_eq!(ids, generate::sample(&new_model, &[p], 5, 0.0)?[0].tokens);
    assert!(matches!(done, Event::Done { ref weight_version, .. } if weight_version == "v1"));
    // A directory of another architecture is refused, and the old weights stay.
    let err = engine
        .update_weights(fixture().with_file_name("llama"), "v2".to_owned())
        .unwrap_err();
    assert!(err.to_string().contains("different architecture"), "{err}");
    assert_eq!(engine.info()?.weight_version, "v1");
    Ok(())
}

/// The in-process handoff into the served model, whose q/k/v and gate/up are views of
/// stacked weights (`Model::fuse_projections`): the engine then decodes exactly what the
/// new weights, loaded plainly, sample.
#[test]
fn weights_handed_over_as_tensors_reach_the_fused_projections() -> anyhow::Result<()> {
    let tmp = tempfile::tempdir()?;
    perturbed(tmp.path())?;
    let new_model = load(tmp.path())?;
    let engine = Engine::start(load(&fixture())?, "v0".to_owned(), 4)?;
    let p = vec![9, 8, 7];
    let old = generate::sample(&load(&fixture())?, std::slice::from_ref(&p), 5, 0.0)?;
    let want = generate::sample(&new_model, std::slice::from_ref(&p), 5, 0.0)?;
    assert_ne!(
        old[0].tokens, want[0].tokens,
        "the perturbation must change the output"
    );
    let (_, rx) = engine.generate(greedy(&p, 5))?;
    assert_eq!(collect(&rx)?.0, old[0].tokens);
    engine.update_weights_from_tensors(new_model.named_parameters(), "v1".to_owned())?;
    let (_, rx) = engine.generate(greedy(&p, 5))?;
    let (ids, logprobs, _) = collect(&rx)?;
    assert_eq!(ids, want[0].tokens);
    for (a, b) in logprobs.iter().zip(&want[0].logprobs) {
        assert!((a - b).abs() < 1e-4, "{a} vs {b}");
    }
    Ok(())
}

#[test]
fn retract_keeps_in_flight_requests_and_finishes_them_with_the_new_weights() -> anyhow::Result<()> {
    let tmp = tempfile::tempdir()?;
    perturbed(tmp.path())?;
    let new_model = load(tmp.path())?;
    let old_model = load(&fixture())?;
    let engine = Engine::start(load(&fixture())?, "v0".to_owned(), 4)?;
    let p = vec![11, 12, 13];
    let n = 120;
    let (_, rx) = engine.generate(greedy(&p, n))?;
    // Wait for three tokens, then swap the weights the way a push does.
    let mut ids = Vec::new();
    while ids.len() < 3 {
        if let Event::Token { id, .. } = rx.recv()? {
            ids.push(id);
        }
    }
    engine.pause(PauseMode::Retract)?;
    engine.flush_cache()?;
    engine.update_weights(tmp.path().to_path_buf(), "v1".to_owned())?;
    engine.resume()?;
    let (rest, _, done) = collect(&rx)?;
    ids.extend(rest);
    assert_eq!(ids.len(), n, "the request was cut short");
    assert!(
        matches!(done, Event::Done { finish: EngineFinish::Length, ref weight_version, .. } if weight_version == "v1")
    );
    // Some prefix came from the old weights, the rest from the new ones continuing it.
    let old = generate::sample(&old_model, std::slice::from_ref(&p), n, 0.0)?[0]
        .tokens
        .clone();
    let k = ids
        .iter()
        .zip(&old)
        .take_while(|(a, b)| a == b)
        .count()
        .max(3);
    let mut prefix = p.clone();
    prefix.extend(&ids[..k]);
    let cont = generate::sample(&new_model, &[prefix], n - k, 0.0)?[0]
        .tokens
        .clone();
    assert_eq!(ids[k..], cont[..]);
    Ok(())
}

#[test]
fn pause_with_abort_ends_requests_in_flight() -> anyhow::Result<()> {
    let engine = Engine::start(load(&fixture())?, "v0".to_owned(), 4)?;
    engine.pause(PauseMode::InPlace)?;
    let (_, rx) = engine.generate(greedy(&[1, 2, 3], 50))?;
    engine.pause(PauseMode::Abort)?;
    let (ids, _, done) = collect(&rx)?;
    assert!(ids.is_empty());
    assert!(matches!(
        done,
        Event::Done {
            finish: EngineFinish::Abort(_),
            ..
        }
    ));
    // In-place holds refuse a flush; after continue the engine serves again.
    engine.resume()?;
    let (_, rx) = engine.generate(greedy(&[1, 2, 3], 2))?;
    assert_eq!(collect(&rx)?.0.len(), 2);
    Ok(())
}

fn request(input: &[i64], n: usize, params: SamplingParams) -> Request {
    Request {
        input_ids: input.to_vec(),
        params: SamplingParams {
            max_new_tokens: n,
            ..params
        },
        ignore_eos: true,
    }
}

/// Requests that join a running batch mid-decode and leave it before others (greedy and
/// seeded sampling with truncation, bias and penalties) get the same tokens and logprobs
/// as each running alone: joining and leaving move cache slots and re-index the batch's
/// sampling state without touching any row's content.
#[test]
fn requests_joining_and_leaving_mid_decode_match_each_alone() -> anyhow::Result<()> {
    let seeded = |seed: u64| SamplingParams {
        temperature: 0.9,
        top_p: 0.9,
        seed: Some(seed),
        ..SamplingParams::default()
    };
    let reqs = [
        request(&[1, 5, 9], 24, seeded(1)),
        request(
            &[2, 3, 4, 5, 6, 7, 8],
            4,
            SamplingParams {
                temperature: 0.0,
                ..SamplingParams::default()
            },
        ),
        request(
            &[40, 41],
            12,
            SamplingParams {
                top_k: 5,
                min_p: 0.05,
                logit_bias: vec![(3, 1.5)],
                ..seeded(2)
            },
        ),
        request(
            &[7; 9],
            6,
            SamplingParams {
                repetition_penalty: 1.4,
                frequency_penalty: 0.7,
                presence_penalty: 0.3,
                ..seeded(3)
            },
        ),
        request(&[11, 12], 9, seeded(4)),
    ];
    let alone: Vec<(Vec<i64>, Vec<f32>)> = reqs
        .iter()
        .map(|r| -> anyhow::Result<_> {
            let engine = Engine::start(load(&fixture())?, "v0".to_owned(), 1)?;
            let (_, rx) = engine.generate(r.clone())?;
            let (ids, lps, _) = collect(&rx)?;
            Ok((ids, lps))
        })
        .collect::<anyhow::Result<_>>()?;
    let engine = Engine::start(load(&fixture())?, "v0".to_owned(), 8)?;
    // The first runs alone for a few tokens, then the others join one by one while it
    // decodes; the second leaves after 4 tokens, the fourth after 6.
    let (_, first) = engine.generate(reqs[0].clone())?;
    let mut got = Vec::new();
    let mut early = Vec::new();
    for _ in 0..3 {
        match first.recv()? {
            Event::Token { id, logprob, .. } => early.push((id, logprob)),
            other => panic!("unexpected {other:?}"),
        }
    }
    let rxs: Vec<_> = reqs[1..]
        .iter()
        .map(|r| engine.generate(r.clone()).map(|(_, rx)| rx))
        .collect::<Result<_, _>>()?;
    let (ids, lps, _) = collect(&first)?;
    let (mut e_ids, mut e_lps): (Vec<i64>, Vec<f32>) = early.into_iter().unzip();
    e_ids.extend(ids);
    e_lps.extend(lps);
    got.push((e_ids, e_lps));
    for rx in &rxs {
        let (ids, lps, _) = collect(rx)?;
        got.push((ids, lps));
    }
    for (i, ((ids, lps), (a_ids, a_lps))) in got.iter().zip(&alone).enumerate() {
        assert_eq!(ids, a_ids, "request {i}: tokens differ from running alone");
        for (a, b) in lps.iter().zip(a_lps) {
            assert!(
                (a - b).abs() < 1e-5,
                "request {i}: logprob {a} vs {b} alone"
            );
        }
    }
    assert!(
        engine.info()?.max_batch_seen >= 3,
        "the requests did not share the batch"
    );
    Ok(())
}
