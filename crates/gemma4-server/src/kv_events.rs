//! The prefix cache's events over ZeroMQ, as vLLM publishes them, so a
//! prefix-aware router (llm-d's endpoint picker) can send each request to
//! the replica that already holds its prefix.
//!
//! A PUB socket bound at `--kv-events-endpoint` sends one multipart message
//! per engine step that changed the cache: the topic, a sequence number (8
//! bytes, big-endian, from 0), and a MessagePack payload
//! `[timestamp, events]`, each event a positional array:
//! `["BlockStored", [hash], parent_hash | nil, token_ids, block_size, nil, nil]`
//! (the nils are the LoRA id and the storage medium) or
//! `["BlockRemoved", [hash], nil]`.
//!
//! The socket is `zeromq`, a pure-Rust implementation: no C library to
//! link, so the static binary stays static. PUB drops messages for a slow
//! subscriber rather than wait, and the engine hands its events over a
//! bounded queue without waiting either: a router that cannot keep up
//! loses events, never slows generation.

use std::convert::Infallible;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use gemma4_engine::{KvEvent, KvEventSink};
use rmp::encode::{self, ByteBuf, ValueWriteError};
use zeromq::{Socket, SocketSend, ZmqMessage};

/// Engine steps whose events may wait for the socket; more are dropped.
const QUEUE_STEPS: usize = 4096;

/// Where and under which topic events are published.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KvEventsConfig {
    /// A ZeroMQ endpoint to bind, such as `tcp://*:5557`.
    pub endpoint: String,
    pub topic: String,
    /// Tokens per KV block, as the engine is configured.
    pub block_size: usize,
}

/// The topic when none is given: `kv@<host>@<model>`, vLLM's form.
pub fn default_topic(host: &str, model: &str) -> String {
    format!("kv@{host}@{model}")
}

/// Binds the socket and starts publishing; the returned sink goes into the
/// engine's configuration.
pub async fn publish(config: KvEventsConfig) -> Result<KvEventSink, String> {
    let mut socket = zeromq::PubSocket::new();
    let bound = socket
        .bind(&config.endpoint)
        .await
        .map_err(|e| format!("cannot bind --kv-events-endpoint {}: {e}", config.endpoint))?;
    tracing::info!(endpoint = %bound, topic = %config.topic, "publishing KV-cache events");
    let (tx, mut rx) = tokio::sync::mpsc::channel::<Vec<KvEvent>>(QUEUE_STEPS);
    let dropped = AtomicU64::new(0);
    tokio::spawn(async move {
        let mut sequence = 0u64;
        while let Some(events) = rx.recv().await {
            let payload = payload(unix_seconds(), &events, config.block_size);
            let frames: Vec<axum::body::Bytes> = vec![
                config.topic.clone().into_bytes().into(),
                sequence.to_be_bytes().to_vec().into(),
                payload.into(),
            ];
            sequence += 1;
            let Ok(message) = ZmqMessage::try_from(frames) else {
                continue;
            };
            if let Err(e) = socket.send(message).await {
                tracing::warn!("cannot publish KV-cache events: {e}");
            }
        }
    });
    let sink = KvEventSink(Arc::new(move |events| {
        if tx.try_send(events).is_err() && dropped.fetch_add(1, Ordering::Relaxed) == 0 {
            tracing::warn!(
                "KV-cache events are published slower than the engine makes them; some are dropped"
            );
        }
    }));
    Ok(sink)
}

fn unix_seconds() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0)
}

/// The MessagePack payload of one message: `[timestamp, events]`.
pub fn payload(timestamp: f64, events: &[KvEvent], block_size: usize) -> Vec<u8> {
    let mut out = ByteBuf::new();
    match write_payload(&mut out, timestamp, events, block_size) {
        Ok(()) => out.into_vec(),
        // Writing into a Vec cannot fail.
        Err(
            ValueWriteError::InvalidMarkerWrite(never) | ValueWriteError::InvalidDataWrite(never),
        ) => match never {},
    }
}

type Written = Result<(), ValueWriteError<Infallible>>;

fn write_payload(
    out: &mut ByteBuf,
    timestamp: f64,
    events: &[KvEvent],
    block_size: usize,
) -> Written {
    encode::write_array_len(out, 2)?;
    encode::write_f64(out, timestamp)?;
    encode::write_array_len(out, events.len() as u32)?;
    for event in events {
        write_event(out, event, block_size)?;
    }
    Ok(())
}

fn write_event(out: &mut ByteBuf, event: &KvEvent, block_size: usize) -> Written {
    match event {
        KvEvent::BlockStored {
            hash,
            parent,
            token_ids,
        } => {
            encode::write_array_len(out, 7)?;
            encode::write_str(out, "BlockStored")?;
            encode::write_array_len(out, 1)?;
            encode::write_uint(out, *hash)?;
            match parent {
                Some(p) => encode::write_uint(out, *p).map(drop)?,
                None => encode::write_nil(out).map_err(ValueWriteError::InvalidMarkerWrite)?,
            }
            encode::write_array_len(out, token_ids.len() as u32)?;
            for &id in token_ids {
                encode::write_uint(out, u64::from(id))?;
            }
            encode::write_uint(out, block_size as u64)?;
            // No LoRA adapter; the medium left to the reader's default.
            encode::write_nil(out).map_err(ValueWriteError::InvalidMarkerWrite)?;
            encode::write_nil(out).map_err(ValueWriteError::InvalidMarkerWrite)?;
        }
        KvEvent::BlockRemoved { hash } => {
            encode::write_array_len(out, 3)?;
            encode::write_str(out, "BlockRemoved")?;
            encode::write_array_len(out, 1)?;
            encode::write_uint(out, *hash)?;
            encode::write_nil(out).map_err(ValueWriteError::InvalidMarkerWrite)?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn payloads_are_positional_msgpack_arrays() {
        let events = [
            KvEvent::BlockStored {
                hash: u64::MAX,
                parent: None,
                token_ids: vec![2, 300],
            },
            KvEvent::BlockStored {
                hash: 7,
                parent: Some(u64::MAX),
                token_ids: vec![1],
            },
            KvEvent::BlockRemoved { hash: 7 },
        ];
        let bytes = payload(1.5, &events, 16);
        let mut expected = vec![0x92, 0xcb];
        expected.extend(1.5f64.to_be_bytes());
        expected.push(0x93);
        // ["BlockStored", [u64::MAX], nil, [2, 300], 16, nil, nil]
        expected.extend([0x97, 0xab]);
        expected.extend(b"BlockStored");
        expected.extend([0x91, 0xcf]);
        expected.extend(u64::MAX.to_be_bytes());
        expected.extend([0xc0, 0x92, 0x02, 0xcd, 0x01, 0x2c, 0x10, 0xc0, 0xc0]);
        // ["BlockStored", [7], u64::MAX, [1], 16, nil, nil]
        expected.extend([0x97, 0xab]);
        expected.extend(b"BlockStored");
        expected.extend([0x91, 0x07, 0xcf]);
        expected.extend(u64::MAX.to_be_bytes());
        expected.extend([0x91, 0x01, 0x10, 0xc0, 0xc0]);
        // ["BlockRemoved", [7], nil]
        expected.extend([0x93, 0xac]);
        expected.extend(b"BlockRemoved");
        expected.extend([0x91, 0x07, 0xc0]);
        assert_eq!(bytes, expected);
    }
}
