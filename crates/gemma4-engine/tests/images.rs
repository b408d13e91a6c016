//! Prompts with images through the engine: chunked prefill (through the soft
//! tokens on causal models; around whole images where they attend to each
//! other), batched with each other, and prefix caching keyed on the media,
//! against the reference's greedy tokens on the vision fixtures.

use std::hash::{DefaultHasher, Hash, Hasher};
use std::path::PathBuf;
use std::sync::Arc;

use gemma4_engine::block_hash::MediaSpan;
use gemma4_engine::{
    CpuExecutor, EncoderInput, EngineConfig, GenerationRequest, SamplingParams, SoftItem,
    SoftPrompt,
};
use gemma4_media::audio::{decode_wav, frames};
use gemma4_media::mel::log_mel;
use gemma4_media::{decode_image, DecodeLimits, ImageProcessor};
use gemma4_model::{
    load_hf_dir, place_soft_tokens, AudioEncoder, AudioFeatures, ImageEncoder, SoftTokenSource,
    VisionInput,
};
use gemma4_text::Tokenizer;

mod support;
use serde_json::Value;
use support::{start_executor_on, start_on, Seam, SEAMS};

const VARIANTS: [&str; 5] = ["e-style", "dense", "moe", "unified", "e-audio"];

fn fixture(variant: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/vision")
        .join(variant)
}

struct Prompt {
    ids: Vec<u32>,
    images: Vec<usize>,
    audios: Vec<usize>,
    greedy: Vec<u32>,
}

fn prompts(variant: &str) -> Vec<Prompt> {
    let text = std::fs::read_to_string(fixture(variant).join("golden.json")).expect("golden.json");
    let golden: Value = serde_json::from_str(&text).expect("json");
    let ints = |v: &Value| -> Vec<u64> {
        v.as_array()
            .map(|a| a.iter().map(|x| x.as_u64().unwrap()).collect())
            .unwrap_or_default()
    };
    golden["prompts"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| Prompt {
            ids: ints(&p["ids"]).into_iter().map(|x| x as u32).collect(),
            images: ints(&p["images"]).into_iter().map(|x| x as usize).collect(),
            audios: ints(&p["audios"]).into_iter().map(|x| x as usize).collect(),
            greedy: ints(&p["greedy"]).into_iter().map(|x| x as u32).collect(),
        })
        .collect()
}

/// The fixture's image encoder and its four test images, processed for it.
fn processed_images(variant: &str) -> (ImageEncoder, Vec<gemma4_media::ProcessedImage>) {
    let dir = fixture(variant);
    let hidden = gemma4_model::TextConfig::from_dir(&dir)
        .unwrap()
        .hidden_size;
    let encoder = ImageEncoder::load_dir(&dir, hidden)
        .unwrap()
        .expect("an image encoder");
    let images = (0..4)
        .map(|i| {
            let png = std::fs::read(dir.join(format!("../images/{i}.png"))).unwrap();
            let img = decode_image(&png, DecodeLimits::default()).unwrap();
            let proc = ImageProcessor::new(70).unwrap();
            if encoder.takes_merged_patches() {
                proc.process_merged(&img)
            } else {
                proc.process(&img)
            }
            .unwrap()
        })
        .collect();
    (encoder, images)
}

/// The fixture's audio encoder and its clip's features (none where the
/// model has no audio).
fn audio_features(variant: &str) -> Option<(AudioEncoder, Vec<f32>)> {
    let dir = fixture(variant);
    let hidden = gemma4_model::TextConfig::from_dir(&dir)
        .unwrap()
        .hidden_size;
    let audio = AudioEncoder::load_dir(&dir, hidden).unwrap()?;
    let wav = std::fs::read(dir.join("../audio/0.wav")).unwrap();
    let clip = decode_wav(&wav, 30.0).unwrap();
    let features = match audio.features() {
        AudioFeatures::LogMel => log_mel(&clip).unwrap().values,
        AudioFeatures::Frames(n) => frames(&clip, n),
    };
    Some((audio, features))
}

/// Each test image's soft tokens.
fn image_features(variant: &str) -> (Vec<Vec<f32>>, u32) {
    let (encoder, images) = processed_images(variant);
    let features = images.iter().map(|p| encode(&encoder, p)).collect();
    (features, encoder.tokens().soft)
}

/// A processed image's (or video frame's) soft tokens, `[tokens · hidden]`.
fn encode(encoder: &ImageEncoder, p: &gemma4_media::ProcessedImage) -> Vec<f32> {
    encoder
        .encode(VisionInput {
            patches: &p.patches,
            positions: &p.positions,
        })
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap()
}

/// The fixture's audio clip as soft tokens (the 12B's frame embedder or the
/// E-style conformer tower), with the audio token id (none elsewhere).
fn audio_clips(variant: &str) -> (u32, Vec<Vec<f32>>) {
    let Some((audio, features)) = audio_features(variant) else {
        return (u32::MAX, Vec::new());
    };
    let soft = audio.encode(&features).unwrap();
    (
        audio.tokens().soft,
        vec![soft.flatten_all().unwrap().to_vec1().unwrap()],
    )
}

fn request(
    ids: &[u32],
    images: &[usize],
    features: &[Vec<f32>],
    image_token: u32,
) -> GenerationRequest {
    media_request(ids, (images, features, image_token), (&[], &[], u32::MAX))
}

/// A golden prompt's request, its media as encoded rows.
fn prompt_request(
    p: &Prompt,
    (features, image_token): (&[Vec<f32>], u32),
    (clips, audio_token): (&[Vec<f32>], u32),
) -> GenerationRequest {
    media_request(
        &p.ids,
        (&p.images, features, image_token),
        (&p.audios, clips, audio_token),
    )
}

fn media_request(
    ids: &[u32],
    (images, features, image_token): (&[usize], &[Vec<f32>], u32),
    (audios, clips, audio_token): (&[usize], &[Vec<f32>], u32),
) -> GenerationRequest {
    let images_v: Vec<&[f32]> = images.iter().map(|&i| features[i].as_slice()).collect();
    let audios_v: Vec<&[f32]> = audios.iter().map(|&i| clips[i].as_slice()).collect();
    // Every fixture's soft tokens are one row of the model's width per token.
    let tokens = ids
        .iter()
        .filter(|&&t| t == image_token || t == audio_token)
        .count();
    let values: usize = images_v.iter().chain(&audios_v).map(|f| f.len()).sum();
    let hidden = values / tokens.max(1);
    let placed = place_soft_tokens(
        ids,
        hidden,
        &[
            SoftTokenSource::images(image_token, &images_v),
            SoftTokenSource::audio(audio_token, &audios_v),
        ],
    )
    .expect("one soft token per placeholder");
    let mut h = DefaultHasher::new();
    (images, audios).hash(&mut h);
    GenerationRequest {
        prompt_ids: ids.to_vec(),
        params: SamplingParams {
            max_tokens: 12,
            ..Default::default()
        },
        deadline: None,
        reading: Default::default(),
        adapter: None,
        soft_prompt: Some(Arc::new(SoftPrompt::from_embeds(
            placed.rows,
            placed.embeds,
            placed.blocks,
            [MediaSpan {
                identifier: format!("{:016x}", h.finish()),
                start: 0,
                end: ids.len(),
            }]
            .into(),
        ))),
    }
}

fn engine(variant: &str) -> gemma4_engine::EngineHandle {
    engine_on(Seam::Direct, variant)
}

fn engine_on(seam: Seam, variant: &str) -> gemma4_engine::EngineHandle {
    let dir = fixture(variant);
    let tokenizer = Arc::new(Tokenizer::from_dir(&dir).expect("tokenizer"));
    let model = load_hf_dir(&dir).expect("model");
    let config = engine_config(&model);
    start_on(seam, model, tokenizer, config)
}

fn engine_config(model: &gemma4_model::Gemma4) -> EngineConfig {
    EngineConfig {
        max_num_seqs: 4,
        max_model_len: 256,
        block_size: 4,
        // Prompts of 70–136 tokens with images of 60–66 soft tokens: chunks of
        // 24 cut through the images of a causal model; with bidirectional
        // images, chunks of 80 end before an image they cannot hold whole.
        max_batch_tokens: if model.config().image_attention.is_bidirectional() {
            80
        } else {
            24
        },
        ..Default::default()
    }
}

#[test]
fn image_prompts_in_chunks_and_batched_keep_the_reference_tokens() {
    for variant in VARIANTS {
        for seam in SEAMS {
            image_prompts_keep_the_reference_tokens(seam, variant);
        }
    }
}

fn image_prompts_keep_the_reference_tokens(seam: Seam, variant: &str) {
    let (features, image_token) = image_features(variant);
    let (audio_token, clips) = audio_clips(variant);
    let engine = engine_on(seam, variant);
    let prompts = prompts(variant);
    let streams: Vec<_> = prompts
        .iter()
        .map(|p| {
            let r = prompt_request(p, (&features, image_token), (&clips, audio_token));
            engine.submit(r).expect("submit")
        })
        .collect();
    for (p, s) in prompts.iter().zip(streams) {
        let (ids, _) = s.blocking_finish().expect("finished");
        assert_eq!(ids, p.greedy, "{variant} {seam:?}");
    }
}

/// Each test image as the vision encoder reads it, and the fixture's clip
/// as the audio encoder reads it (none where the model has no audio).
fn encoder_inputs(variant: &str) -> (Vec<EncoderInput>, Vec<EncoderInput>) {
    let images = processed_images(variant)
        .1
        .into_iter()
        .map(|p| EncoderInput::Image {
            patches: p.patches,
            positions: p.positions,
        })
        .collect();
    let audio = audio_features(variant)
        .map(|(_, features)| EncoderInput::Audio { features })
        .into_iter()
        .collect();
    (images, audio)
}

/// The request of [`media_request`] with its media as encoder inputs: each
/// run of placeholders in the prompt, in order, is the next image or clip.
fn encoder_request(
    p: &Prompt,
    request: GenerationRequest,
    (images, audio): &(Vec<EncoderInput>, Vec<EncoderInput>),
    (image_token, audio_token): (u32, u32),
) -> GenerationRequest {
    let Some(soft) = request.soft_prompt.as_deref() else {
        return request;
    };
    let (mut next_image, mut next_audio) = (p.images.iter(), p.audios.iter());
    let mut items = Vec::new();
    let mut i = 0;
    while i < p.ids.len() {
        let t = p.ids[i];
        let run = p.ids[i..].iter().take_while(|&&x| x == t).count();
        let input = if t == image_token {
            next_image.next().map(|&k| images[k].clone())
        } else if t == audio_token {
            next_audio.next().map(|&k| audio[k].clone())
        } else {
            None
        };
        if let Some(input) = input {
            items.push(SoftItem {
                input,
                soft_tokens: run,
            });
        }
        i += run;
    }
    let soft = SoftPrompt {
        items,
        ..soft.clone()
    };
    GenerationRequest {
        soft_prompt: Some(Arc::new(soft)),
        ..request
    }
}

/// The executor runs the encoders on their thread, one item at a time
/// under an encoder budget of one soft token, while the other prompts'
/// steps go on, directly and over the threaded seam: the reference's tokens.
#[test]
fn encoders_run_in_the_executor_within_the_step_budget() {
    for variant in VARIANTS {
        let dir = fixture(variant);
        let (features, image_token) = image_features(variant);
        let (audio_token, clips) = audio_clips(variant);
        let inputs = encoder_inputs(variant);
        for seam in SEAMS {
            let model = load_hf_dir(&dir).expect("model");
            let hidden = model.config().hidden_size;
            let images = ImageEncoder::load_dir(&dir, hidden).unwrap();
            let audio = AudioEncoder::load_dir(&dir, hidden).unwrap();
            let config = EngineConfig {
                encoder_budget: Some(1),
                ..engine_config(&model)
            };
            let cpu = CpuExecutor::new(model)
                .with_encoders(images, audio)
                .expect("encoders");
            let tokenizer = Arc::new(Tokenizer::from_dir(&dir).expect("tokenizer"));
            let engine = start_executor_on(seam, cpu, tokenizer, config);
            let prompts = prompts(variant);
            let requests: Vec<GenerationRequest> = prompts
                .iter()
                .map(|p| {
                    let r = prompt_request(p, (&features, image_token), (&clips, audio_token));
                    encoder_request(p, r, &inputs, (image_token, audio_token))
                })
                .collect();
            // The encoders have work: every image and clip goes in as pixels or features.
            let kinds: Vec<&EncoderInput> = requests
                .iter()
                .filter_map(|r| r.soft_prompt.as_deref())
                .flat_map(|s| s.items.iter().map(|i| &i.input))
                .collect();
            let sent = |image: bool| {
                kinds
                    .iter()
                    .filter(|k| matches!(k, EncoderInput::Image { .. }) == image)
                    .count()
            };
            let want_images: usize = prompts.iter().map(|p| p.images.len()).sum();
            let want_audio: usize = prompts.iter().map(|p| p.audios.len()).sum();
            assert_eq!(
                (sent(true), sent(false)),
                (want_images, want_audio),
                "{variant}"
            );
            assert!(want_images > 0, "{variant}: no image to encode");
            let streams: Vec<_> = requests
                .into_iter()
                .map(|r| engine.submit(r).expect("submit"))
                .collect();
            for (p, s) in prompts.iter().zip(streams) {
                let (ids, _) = s.blocking_finish().expect("finished");
                assert_eq!(ids, p.greedy, "{variant} {seam:?}");
            }
        }
    }
}

#[test]
fn a_cached_prefix_is_never_shared_between_different_images() {
    // Images 0 and 2 both become 63 soft tokens, so prompt 0's ids hold
    // either; only the media key tells the cached blocks apart.
    let (features, image_token) = image_features("e-style");
    assert_eq!(features[0].len(), features[2].len());
    let engine = engine("e-style");
    let p = &prompts("e-style")[0];
    let run = |images: &[usize]| {
        engine
            .submit(request(&p.ids, images, &features, image_token))
            .unwrap()
            .blocking_finish()
            .unwrap()
            .0
    };
    assert_eq!(run(&[0]), p.greedy);
    let other = run(&[2]);
    assert_ne!(
        other, p.greedy,
        "image 2 must not read image 0's cached blocks"
    );
    // Image 2 alone, on an engine that has never seen image 0.
    let fresh = engine_fresh_run(&p.ids, &features, image_token);
    assert_eq!(other, fresh);
    // And the same image again reuses its own blocks with the same result.
    assert_eq!(run(&[0]), p.greedy);
}

fn engine_fresh_run(ids: &[u32], features: &[Vec<f32>], image_token: u32) -> Vec<u32> {
    engine("e-style")
        .submit(request(ids, &[2], features, image_token))
        .unwrap()
        .blocking_finish()
        .unwrap()
        .0
}

#[test]
fn encoder_rows_that_do_not_fit_the_prompt_are_refused() {
    let e_style = engine("e-style");
    let mut r = request(&[2, 7], &[], &[], 500);
    // Two placeholder rows but no values.
    r.prompt_ids = vec![2, 500, 500, 7];
    r.soft_prompt = Some(Arc::new(SoftPrompt::from_embeds(
        vec![1, 2],
        Vec::new(),
        Vec::new(),
        [].into(),
    )));
    assert!(e_style.submit(r.clone()).is_err());
    r.soft_prompt = Some(Arc::new(SoftPrompt::from_embeds(
        vec![9],
        vec![0.0; 64],
        Vec::new(),
        [].into(),
    )));
    assert!(e_style.submit(r).is_err());
    // An image that attends to itself must fit one step.
    let dense = engine("dense");
    let ids: Vec<u32> = std::iter::once(2)
        .chain(std::iter::repeat_n(500, 81))
        .chain([7])
        .collect();
    let r = request(&[2, 7], &[], &[], 500);
    let r = GenerationRequest {
        prompt_ids: ids,
        reading: Default::default(),
        adapter: None,
        soft_prompt: Some(Arc::new(SoftPrompt::from_embeds(
            (1..82).collect(),
            vec![0.0; 81 * 128],
            vec![(1, 82)],
            [].into(),
        ))),
        ..r
    };
    let err = dense.submit(r).err().expect("refused").to_string();
    assert!(err.contains("does not fit one step"), "{err}");
}

/// The fixture's chat turns with a video (alone, and after image 1) and its
/// text-only turns, as engine requests, with their reference tokens.
fn video_requests(variant: &str) -> Vec<(GenerationRequest, Vec<u32>)> {
    use gemma4_media::video::{decode_video, DEFAULT_VIDEO_FRAMES, VIDEO_SOFT_TOKENS};
    use gemma4_media::{Rescale, VideoLimits};

    let dir = fixture(variant);
    let golden: Value = serde_json::from_str(
        &std::fs::read_to_string(dir.join("video_golden.json")).expect("video_golden.json"),
    )
    .expect("json");
    let hidden = gemma4_model::TextConfig::from_dir(&dir)
        .unwrap()
        .hidden_size;
    let encoder = ImageEncoder::load_dir(&dir, hidden).unwrap().unwrap();
    let gif = std::fs::read(dir.join(golden["video"].as_str().unwrap())).unwrap();
    let video = decode_video(&gif, &VideoLimits::default(), DEFAULT_VIDEO_FRAMES).unwrap();
    let proc = ImageProcessor::new(VIDEO_SOFT_TOKENS).unwrap();
    let frames: Vec<Vec<f32>> = video
        .frames
        .iter()
        .map(|frame| {
            let p = proc
                .process_with(frame, encoder.takes_merged_patches(), Rescale::Divide)
                .unwrap();
            encode(&encoder, &p)
        })
        .collect();
    let (images, image_token) = image_features(variant);
    let ints = |v: &Value| -> Vec<u32> {
        v.as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_u64().unwrap() as u32)
            .collect()
    };
    let mut out = Vec::new();
    for (k, chat) in golden["chats"].as_array().unwrap().iter().enumerate() {
        let ids = ints(&chat["ids"]);
        let media: Vec<&str> = chat["media"]
            .as_array()
            .unwrap()
            .iter()
            .map(|m| m.as_str().unwrap())
            .collect();
        let image_rows: Vec<&[f32]> = if media.contains(&"image") {
            vec![images[1].as_slice()]
        } else {
            Vec::new()
        };
        let frame_rows: Vec<&[f32]> = if media.contains(&"video") {
            frames.iter().map(Vec::as_slice).collect()
        } else {
            Vec::new()
        };
        let placed = place_soft_tokens(
            &ids,
            hidden,
            &[
                SoftTokenSource::images(image_token, &image_rows),
                SoftTokenSource::video_frames(encoder.video_tokens().soft, &frame_rows),
            ],
        )
        .unwrap();
        let soft_prompt = (!placed.rows.is_empty()).then(|| {
            Arc::new(SoftPrompt::from_embeds(
                placed.rows,
                placed.embeds,
                placed.blocks,
                [MediaSpan {
                    identifier: format!("case {k}"),
                    start: 0,
                    end: ids.len(),
                }]
                .into(),
            ))
        });
        let request = GenerationRequest {
            prompt_ids: ids,
            params: SamplingParams {
                max_tokens: 12,
                ..Default::default()
            },
            deadline: None,
            soft_prompt,
            reading: Default::default(),
            adapter: None,
        };
        out.push((request, ints(&chat["greedy"])));
    }
    let plain = &golden["plain"];
    out.push((
        GenerationRequest {
            prompt_ids: ints(&plain["ids"]),
            params: SamplingParams {
                max_tokens: 12,
                ..Default::default()
            },
            deadline: None,
            soft_prompt: None,
            reading: Default::default(),
            adapter: None,
        },
        ints(&plain["greedy"]),
    ));
    out
}

#[test]
fn video_and_text_only_prompts_batched_and_chunked_keep_the_reference_tokens() {
    for variant in VARIANTS {
        let requests = video_requests(variant);
        let model = load_hf_dir(&fixture(variant)).expect("model");
        let bidirectional = model.config().image_attention.is_bidirectional();
        let tokenizer = Arc::new(Tokenizer::from_dir(&fixture(variant)).expect("tokenizer"));
        let config = EngineConfig {
            max_num_seqs: 4,
            max_model_len: 2432,
            block_size: 16,
            // Frames of 63 soft tokens: chunks of 48 cut through them on a
            // causal model; with bidirectional frames, chunks of 96 end
            // before a frame they cannot hold whole.
            max_batch_tokens: if bidirectional { 96 } else { 48 },
            ..Default::default()
        };
        for seam in SEAMS {
            let model = load_hf_dir(&fixture(variant)).expect("model");
            let engine = start_on(seam, model, tokenizer.clone(), config.clone());
            // All four at once: two video prompts and two text-only ones share
            // the steps.
            let streams: Vec<_> = requests
                .iter()
                .map(|(r, _)| engine.submit(r.clone()).expect("submit"))
                .collect();
            for (k, ((_, greedy), s)) in requests.iter().zip(streams).enumerate() {
                let (ids, _) = s.blocking_finish().expect("finished");
                assert_eq!(&ids, greedy, "{variant} {seam:?} request {k}");
            }
        }
    }
}
