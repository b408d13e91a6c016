//! `gemma4 verify` on a golden file with images (and audio, on the 12B;
//! written by `tools/make_vision_fixture.py`): stage by stage — the
//! processor's resized pixels, the encoders' soft tokens, then prompts holding
//! the media (logits at the last prompt position and the greedy tokens) — and
//! the first stage that departs from the reference is named.

use std::path::Path;

use anyhow::{bail, Context, Result};
use gemma4_media::audio::decode_wav;
use gemma4_media::{decode_image, resize::resize_bicubic, DecodeLimits};
use gemma4_model::golden::greedy_with_soft_tokens;
use gemma4_model::{place_soft_tokens, AudioFeatures, Gemma4, SoftTokenSource, VisionInput};
use gemma4_server::media::processor_for;
use serde::Deserialize;

/// A golden file with images.
#[derive(Debug, Deserialize)]
pub struct VisionGolden {
    pub max_soft_tokens: usize,
    /// Image paths, relative to the golden file.
    pub images: Vec<String>,
    /// WAV paths, relative to the golden file.
    #[serde(default)]
    pub audios: Vec<String>,
    pub prompts: Vec<VisionPrompt>,
}

#[derive(Debug, Deserialize)]
pub struct VisionPrompt {
    pub ids: Vec<u32>,
    pub images: Vec<usize>,
    #[serde(default)]
    pub audios: Vec<usize>,
    pub greedy: Vec<u32>,
}

impl VisionGolden {
    /// The file as a golden with images, or `None` when it is another format.
    pub fn read(path: &Path) -> Result<Option<Self>> {
        read_golden(
            path,
            &["images", "max_soft_tokens"],
            "a golden file with images",
        )
    }
}

/// A golden file as `T` when its JSON has every key of `keys` (`None` when
/// it lacks one: another format); `what` names `T` in errors.
pub fn read_golden<T: serde::de::DeserializeOwned>(
    path: &Path,
    keys: &[&str],
    what: &str,
) -> Result<Option<T>> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("cannot read golden file {}", path.display()))?;
    let json: serde_json::Value =
        serde_json::from_str(&text).with_context(|| format!("{} is not JSON", path.display()))?;
    if keys.iter().any(|k| json.get(k).is_none()) {
        return Ok(None);
    }
    Ok(Some(serde_json::from_value(json).with_context(|| {
        format!("{} is not {what}", path.display())
    })?))
}

/// Golden tensors by name (f32 or u8), read once.
pub struct Tensors(Vec<u8>);

impl Tensors {
    pub fn read(path: &Path) -> Result<Self> {
        Ok(Self(std::fs::read(path).with_context(|| {
            format!("cannot read the golden tensors {}", path.display())
        })?))
    }

    fn get(&self, name: &str) -> Result<Option<(safetensors::Dtype, Vec<u8>)>> {
        let st = safetensors::SafeTensors::deserialize(&self.0).context("golden tensors")?;
        Ok(st.tensor(name).ok().map(|t| (t.dtype(), t.data().to_vec())))
    }

    pub fn f32s(&self, name: &str) -> Result<Vec<f32>> {
        match self.get(name)? {
            Some((safetensors::Dtype::F32, bytes)) => Ok(bytes
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect()),
            _ => bail!("golden tensor {name} (f32) is missing"),
        }
    }
}

pub fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

/// Soft tokens against the reference's: the largest difference, and whether
/// it is within what f32 against f32 gives (the same operations summed in
/// another order: 1e-4 of the largest value).
pub fn close_to_reference(ours: &[f32], want: &[f32]) -> (f32, bool) {
    let scale = want.iter().fold(0f32, |m, x| m.max(x.abs())).max(1.0);
    let diff = if ours.len() == want.len() {
        max_abs_diff(ours, want)
    } else {
        f32::INFINITY
    };
    (diff, diff <= 1e-4 * scale)
}

/// Runs one prompt with its encoder rows and prints a `MATCH`/`DIFF` line
/// against the reference's last-position logits and greedy tokens; returns
/// whether it matched.
pub fn check_prompt(
    model: &Gemma4,
    (ids, soft): (&[u32], Option<gemma4_model::SoftTokens<'_>>),
    (greedy, logits_want): (&[u32], &[f32]),
    tolerance: f32,
    label: &str,
) -> Result<bool> {
    let (logits, ours) = greedy_with_soft_tokens(model, ids, soft, greedy.len())?;
    let diff = max_abs_diff(&logits, logits_want);
    let same = ours.iter().zip(greedy).take_while(|(a, b)| a == b).count();
    let ok = diff <= tolerance && same == greedy.len();
    println!(
        "{} {label} tokens={} greedy={same}/{} max_abs_logit_diff={diff:.3e}{}",
        if ok { "MATCH" } else { "DIFF " },
        ids.len(),
        greedy.len(),
        if ok {
            ""
        } else {
            " stage=text model with merged embeddings"
        }
    );
    Ok(ok)
}

/// Checks every stage; returns whether everything matched.
pub fn verify(
    model: &Gemma4,
    (checkpoint, mmproj): (&Path, Option<&Path>),
    golden_path: &Path,
    golden: &VisionGolden,
    tolerance: f32,
) -> Result<bool> {
    let (images, audio) =
        crate::model_io::load_media_encoders(checkpoint, mmproj, model.config().hidden_size)?;
    let encoder =
        images.context("the golden file holds images, but the model has no vision tower")?;
    let tensors = Tensors::read(&golden_path.with_file_name("golden_tensors.safetensors"))?;
    let facts = gemma4_engine::encoders::media_facts(Some(&encoder), None)
        .image
        .context("the model has no vision tower")?;
    let processor = processor_for(&facts, golden.max_soft_tokens)?;
    let dir = golden_path.parent().unwrap_or(Path::new("."));
    let mut all = true;
    let mut features = Vec::with_capacity(golden.images.len());
    for (i, rel) in golden.images.iter().enumerate() {
        let path = dir.join(rel);
        let bytes =
            std::fs::read(&path).with_context(|| format!("cannot read {}", path.display()))?;
        let img = decode_image(&bytes, DecodeLimits::default())
            .with_context(|| format!("{}", path.display()))?;
        let processed = if encoder.takes_merged_patches() {
            processor.process_merged(&img)?
        } else {
            processor.process(&img)?
        };
        // Stage 1: the processor's resized pixels, byte for byte, where recorded.
        if let Some((_, want)) = tensors.get(&format!("pixels.{i}"))? {
            let ours = resize_bicubic(&img, processed.width, processed.height).pixels;
            let differing = ours.iter().zip(&want).filter(|(a, b)| a != b).count()
                + ours.len().abs_diff(want.len());
            if differing > 0 {
                println!("DIFF  image={i} stage=processor output: {differing} of {} resized bytes differ", want.len());
                all = false;
                continue;
            }
        }
        // Stage 2: the encoder's soft tokens.
        let ours: Vec<f32> = encoder
            .encode(VisionInput {
                patches: &processed.patches,
                positions: &processed.positions,
            })?
            .flatten_all()?
            .to_vec1()?;
        let (diff, ok) = close_to_reference(&ours, &tensors.f32s(&format!("features.{i}"))?);
        all &= ok;
        println!(
            "{} image={i} resized={}x{} soft_tokens={} max_abs_diff={diff:.3e}{}",
            if ok { "MATCH" } else { "DIFF " },
            processed.width,
            processed.height,
            processed.soft_tokens,
            if ok { "" } else { " stage=encoder output" }
        );
        features.push(ours);
    }
    if features.len() != golden.images.len() {
        println!("SEQ_MATCH false (the processor departs; prompts not run)");
        return Ok(false);
    }
    let hidden = model.config().hidden_size;
    let mut clips = Vec::with_capacity(golden.audios.len());
    for (i, rel) in golden.audios.iter().enumerate() {
        let audio = audio
            .as_ref()
            .context("the golden file holds audio, but the checkpoint has no audio encoder")?;
        let path = dir.join(rel);
        let bytes =
            std::fs::read(&path).with_context(|| format!("cannot read {}", path.display()))?;
        let clip = decode_wav(&bytes, 30.0).with_context(|| format!("{}", path.display()))?;
        let input = gemma4_server::media::audio_input(audio.features(), &clip)
            .with_context(|| format!("{}", path.display()))?;
        if audio.features() == AudioFeatures::LogMel {
            // The processor stage: the log-mel features, where the golden has them.
            if let Ok(want) = tensors.f32s(&format!("mel.{i}")) {
                let (diff, ok) = close_to_reference(&input, &want);
                all &= ok;
                println!(
                    "{} audio={i} mel_frames={} max_abs_diff={diff:.3e}{}",
                    if ok { "MATCH" } else { "DIFF " },
                    input.len() / gemma4_media::mel::MEL_BINS,
                    if ok { "" } else { " stage=processor output" }
                );
                if !ok {
                    println!("SEQ_MATCH false (the audio processor departs; prompts not run)");
                    return Ok(false);
                }
            }
        }
        let ours: Vec<f32> = audio.encode(&input)?.flatten_all()?.to_vec1()?;
        let (diff, ok) = close_to_reference(&ours, &tensors.f32s(&format!("audio_features.{i}"))?);
        all &= ok;
        println!(
            "{} audio={i} seconds={:.2} soft_tokens={} max_abs_diff={diff:.3e}{}",
            if ok { "MATCH" } else { "DIFF " },
            clip.seconds(),
            ours.len() / hidden,
            if ok {
                ""
            } else {
                " stage=audio encoder output"
            }
        );
        clips.push(ours);
    }
    let image_token = encoder.tokens().soft;
    let audio_token = audio.as_ref().map_or(u32::MAX, |a| a.tokens().soft);
    for (n, p) in golden.prompts.iter().enumerate() {
        let images: Vec<&[f32]> = p.images.iter().map(|&i| features[i].as_slice()).collect();
        let audios: Vec<&[f32]> = p.audios.iter().map(|&i| clips[i].as_slice()).collect();
        let placed = place_soft_tokens(
            &p.ids,
            hidden,
            &[
                SoftTokenSource::images(image_token, &images),
                SoftTokenSource::audio(audio_token, &audios),
            ],
        )
        .with_context(|| format!("prompt {n}"))?;
        all &= check_prompt(
            model,
            (&p.ids, Some(placed.as_soft_tokens())),
            (&p.greedy, &tensors.f32s(&format!("logits.{n}"))?),
            tolerance,
            &format!("prompt={n} images={:?} audio={:?}", p.images, p.audios),
        )?;
    }
    Ok(all)
}
