//! The models against HF transformers: tiny random Llama, Qwen2 and Qwen3 checkpoints and
//! the logits transformers computed for them (trainer/tests/fixtures/models, made by
//! scripts/hf-model-fixtures.py).

use std::path::PathBuf;

use graft_trainer::model::{KvCache, Model, SlotCache};
use graft_trainer::weights;
use tch::{Device, Kind, Tensor};

const TOL: f64 = 1e-4;

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/models")
        .join(name)
}

fn load(name: &str) -> anyhow::Result<(Model, Tensor, Tensor)> {
    let dev = graft_trainer::device::init();
    assert_eq!(
        dev.device,
        Device::Cpu,
        "these tests compare f32 logits on the CPU"
    );
    let dir = fixture(name);
    let model = Model::load(&dir, Device::Cpu, Kind::Float)?;
    let mut reference = weights::read_file(&dir.join("reference.safetensors"))?;
    let ids = reference
        .remove("input_ids")
        .ok_or_else(|| anyhow::anyhow!("no input_ids"))?;
    let logits = reference
        .remove("logits")
        .ok_or_else(|| anyhow::anyhow!("no logits"))?;
    Ok((model, ids, logits))
}

fn max_abs_diff(a: &Tensor, b: &Tensor) -> anyhow::Result<f64> {
    assert_eq!(a.size(), b.size());
    Ok(a.f_sub(b)?.f_abs()?.f_max()?.f_double_value(&[])?)
}

fn matches_hf(name: &str) -> anyhow::Result<()> {
    let (model, ids, want) = load(name)?;
    let got = tch::no_grad(|| model.forward(&ids))?;
    let diff = max_abs_diff(&got, &want)?;
    let scale = want.f_abs()?.f_max()?.f_double_value(&[])?;
    assert!(
        scale > 1.0,
        "{name}: reference logits are too flat to test anything ({scale})"
    );
    assert!(
        diff < TOL,
        "{name}: max |ours - HF| = {diff} (logits up to {scale})"
    );
    Ok(())
}

#[test]
fn llama_logits_match_transformers() -> anyhow::Result<()> {
    matches_hf("llama")
}

#[test]
fn qwen2_logits_match_transformers() -> anyhow::Result<()> {
    matches_hf("qwen2")
}

#[test]
fn qwen3_sharded_logits_match_transformers() -> anyhow::Result<()> {
    assert!(
        fixture("qwen3")
            .join("model.safetensors.index.json")
            .exists()
    );
    matches_hf("qwen3")
}

/// Prefill, then one token at a time, then a chunk of several (the masked path): the
/// cached logits equal the full forward's.
fn kv_cache_matches_full(name: &str) -> anyhow::Result<()> {
    let (model, ids, _) = load(name)?;
    let full = tch::no_grad(|| model.forward(&ids))?;
    let t = ids.size()[1];
    let mut cache = KvCache::new();
    let mut parts = Vec::new();
    let mut pos = 0;
    for len in [4, 1, 1, 3, 1] {
        let chunk = ids.f_narrow(1, pos, len)?;
        parts.push(tch::no_grad(|| model.forward_step(&chunk, &mut cache))?);
        pos += len;
        assert_eq!(cache.len(), pos);
    }
    let rest = ids.f_narrow(1, pos, t - pos)?;
    parts.push(tch::no_grad(|| model.forward_step(&rest, &mut cache))?);
    let inc = Tensor::f_cat(&parts, 1)?;
    let diff = max_abs_diff(&inc, &full)?;
    assert!(
        diff < TOL,
        "{name}: incremental vs full logits differ by {diff}"
    );
    Ok(())
}

/// A long decode, one token at a time over two rows, so the cache's buffers fill and grow
/// several times. Every step's logits equal the full forward's at that position.
#[test]
fn kv_cache_grows_in_place_over_a_long_decode() -> anyhow::Result<()> {
    let (model, _, _) = load("llama")?;
    tch::manual_seed(7);
    let t = 90;
    let ids = Tensor::f_randint(160, [2, t], (Kind::Int64, Device::Cpu))?;
    let full = tch::no_grad(|| model.forward(&ids))?;
    let mut cache = KvCache::new();
    for pos in 0..75 {
        let got = tch::no_grad(|| model.forward_step(&ids.f_narrow(1, pos, 1)?, &mut cache))?;
        let diff = max_abs_diff(&got, &full.f_narrow(1, pos, 1)?)?;
        assert!(diff < TOL, "position {pos}: cached logits differ by {diff}");
        assert_eq!(cache.len(), pos + 1);
    }
    Ok(())
}

/// The serving engine's slot cache: three rows of different prompt lengths prefilled
/// together (padded on the right), then decoded one position each per step (each row at
/// its own position) until the buffers have grown several times, then the last row moved
/// into the first row's slot (as when the first row leaves) and decoded on. Every logit
/// equals the full forward's at that row and position, for every family.
#[test]
fn slot_cache_rows_at_their_own_positions_equal_the_full_forward() -> anyhow::Result<()> {
    for name in ["llama", "qwen2", "qwen3"] {
        let (model, _, _) = load(name)?;
        tch::manual_seed(11);
        let t = 80;
        let ids = Tensor::f_randint(160, [3, t], (Kind::Int64, Device::Cpu))?;
        let full = tch::no_grad(|| model.forward(&ids))?;
        let expect =
            |row: i64, pos: i64| -> anyhow::Result<Tensor> { Ok(full.f_get(row)?.f_get(pos)?) };
        let mut cache = SlotCache::new();
        let mut lens = vec![5i64, 1, 12];
        let prefix = ids.f_narrow(1, 0, 12)?;
        let hidden = tch::no_grad(|| model.prefill_slots(&prefix, &lens, &mut cache, 0))?;
        let logits = model.logits(&hidden)?;
        for (r, &l) in lens.iter().enumerate() {
            let diff = max_abs_diff(&logits.f_get(r as i64)?, &expect(r as i64, l - 1)?)?;
            assert!(
                diff < TOL,
                "{name}: prefill row {r}: logits differ by {diff}"
            );
        }
        let first_cap = cache.capacity().1;
        // rows[slot] = the row of `ids` in that slot.
        let mut rows = vec![0i64, 1, 2];
        let decode = |cache: &mut SlotCache, rows: &[i64], lens: &[i64]| -> anyhow::Result<()> {
            let next: Vec<i64> = rows
                .iter()
                .zip(lens)
                .map(|(&r, &l)| ids.int64_value(&[r, l]))
                .collect();
            let hidden = tch::no_grad(|| {
                model.decode_slots(
                    &Tensor::from_slice(&next),
                    &Tensor::from_slice(lens),
                    lens.iter().copied().max().unwrap_or(0),
                    cache,
                )
            })?;
            let logits = model.logits(&hidden)?;
            for (slot, (&r, &l)) in rows.iter().zip(lens).enumerate() {
                let diff = max_abs_diff(&logits.f_get(slot as i64)?, &expect(r, l)?)?;
                assert!(
                    diff < TOL,
                    "{name}: row {r} at {l}: logits differ by {diff}"
                );
            }
            Ok(())
        };
        for _ in 0..55 {
            decode(&mut cache, &rows, &lens)?;
            lens.iter_mut().for_each(|l| *l += 1);
        }
        assert!(
            cache.capacity().1 > first_cap + 40,
            "{name}: the cache grew ({first_cap} -> {:?})",
            cache.capacity()
        );
        // Row 0 leaves: the last row moves into its slot.
        cache.move_row(2, 0, lens[2])?;
        rows = vec![2, 1];
        lens = vec![lens[2], lens[1]];
        for _ in 0..10 {
            decode(&mut cache, &rows, &lens)?;
            lens.iter_mut().for_each(|l| *l += 1);
        }
    }
    Ok(())
}

#[test]
fn kv_cache_forward_equals_full_forward() -> anyhow::Result<()> {
    for name in ["llama", "qwen2", "qwen3"] {
        kv_cache_matches_full(name)?;
    }
    Ok(())
}

/// Writing a model (sharded) and loading it back gives the same logits; a tied lm_head
/// is not written, as HF does.
#[test]
fn written_model_dir_loads_back_identically() -> anyhow::Result<()> {
    for name in ["qwen2", "qwen3"] {
        let (model, ids, want) = load(name)?;
        let tmp = tempfile::tempdir()?;
        weights::write_dir(
            tmp.path(),
            model.raw_config(),
            &model.named_parameters(),
            Kind::Float,
            30_000,
        )?;
        assert!(tmp.path().join("model.safetensors.index.json").exists());
        let again = Model::load(tmp.path(), Device::Cpu, Kind::Float)?;
        let got = tch::no_grad(|| again.forward(&ids))?;
        assert!(max_abs_diff(&got, &want)? < TOL);
        let names = weights::read_dir(tmp.path())?;
        assert_eq!(
            names.contains_key("lm_head.weight"),
            !model.spec().tie_word_embeddings
        );
    }
    Ok(())
}

#[test]
fn a_missing_tensor_is_named() -> anyhow::Result<()> {
    let tmp = tempfile::tempdir()?;
    let (model, _, _) = load("llama")?;
    let params: Vec<_> = model
        .named_parameters()
        .into_iter()
        .filter(|(n, _)| n != "model.layers.1.mlp.up_proj.weight")
        .collect();
    weights::write_dir(
        tmp.path(),
        model.raw_config(),
        &params,
        Kind::Float,
        usize::MAX,
    )?;
    let err = Model::load(tmp.path(), Device::Cpu, Kind::Float)
        .map(|_| ())
        .unwrap_err()
        .to_string();
    assert!(err.contains("model.layers.1.mlp.up_proj.weight"), "{err}");
    Ok(())
}

#[test]
fn cpu_machine_reports_why_not_cuda() {
    let info = graft_trainer::device::init();
    if info.device == Device::Cpu {
        assert!(info.cpu_reason.is_some());
    } else {
        assert!(info.cuda_devices > 0);
    }
}
