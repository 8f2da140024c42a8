//! Reading packs from the store through the manifest's signed URLs.
//!
//! - META packs are downloaded whole and checked end to end: the SHA-256 of
//!   the bytes is the pack id, the header names the right kind, the trailer
//!   agrees with the manifest, the sealed index authenticates.
//! - DATA packs are never downloaded whole: their header and their index
//!   (with the trailer right behind it) come by ranged GETs, and then only
//!   the byte ranges of the blobs a restore needs, coalesced into few
//!   requests ([`coalesce`]).
//! - With a host pack cache ([`super::packcache`]) a META pack or a DATA
//!   index is taken from the cache when a piece holds it and it passes the
//!   same checks; a piece that fails them is dropped and the bytes come from
//!   the store, which then go into the cache.
//! - A URL can expire during a long restore. A 403 makes the fetcher ask the
//!   coordinator for a fresh manifest and retry with the new URL; that is
//!   bounded so that a store that refuses everything fails quickly.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLock};

use bytes::Bytes;
use cairn_proto::ids::PackId;
use cairn_proto::pb;
use sha2::{Digest, Sha256};

use crate::format::{
    PACK_HEADER_LEN, PACK_TRAILER_LEN, PackIndex, TenantKeys, parse_pack_header, parse_trailer,
};
use crate::transfer::{BlobTransfer, BodyBuffers, TransferError};

use super::manifest::{ManifestSource, PackInfo};
use super::packcache::PackCache;
use crate::task::blocking;

/// How many times one restore may ask for fresh URLs after a 403.
pub(crate) const MAX_URL_REFRESHES: u32 = 3;

/// Why bytes of a pack could not be fetched.
#[derive(Debug, thiserror::Error)]
pub enum FetchError {
    #[error("pack {pack} is missing from the store (404)")]
    Missing { pack: PackId },
    #[error("pack {pack}: {source}")]
    Transfer { pack: PackId, source: TransferError },
    #[error("the manifest has no URL for pack {pack}")]
    NoUrl { pack: PackId },
    #[error("asking the coordinator for fresh URLs failed: {0}")]
    Refresh(tonic::Status),
}

/// Why a pack's bytes are not what the manifest says they are.
#[derive(Debug, thiserror::Error)]
#[error("pack {pack} is corrupt: {reason}")]
pub struct CorruptPack {
    pub pack: PackId,
    pub reason: String,
}

/// Fetches pack bytes by pack id, refreshing expired URLs.
pub struct PackFetcher<'a> {
    transfer: BlobTransfer,
    /// Reused for every body this restore downloads.
    buffers: BodyBuffers,
    urls: RwLock<HashMap<PackId, String>>,
    refreshes: tokio::sync::Mutex<u32>,
    source: &'a dyn ManifestSource,
    request: pb::GetRestoreManifestRequest,
    downloaded: AtomicU64,
    cache: Option<Arc<PackCache>>,
    from_cache: AtomicU64,
}

impl std::fmt::Debug for PackFetcher<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PackFetcher").finish_non_exhaustive()
    }
}

impl<'a> PackFetcher<'a> {
    /// `request` is what produced `urls`; it is sent again for fresh URLs.
    pub fn new(
        transfer: BlobTransfer,
        source: &'a dyn ManifestSource,
        request: pb::GetRestoreManifestRequest,
        urls: HashMap<PackId, String>,
    ) -> Self {
        Self {
            transfer,
            buffers: BodyBuffers::default(),
            urls: RwLock::new(urls),
            refreshes: tokio::sync::Mutex::new(0),
            source,
            request,
            downloaded: AtomicU64::new(0),
            cache: None,
            from_cache: AtomicU64::new(0),
        }
    }

    /// Reads through the host's pack cache (and fills it).
    pub fn with_pack_cache(mut self, cache: Option<Arc<PackCache>>) -> Self {
        self.cache = cache;
        self
    }

    pub fn pack_cache(&self) -> Option<&Arc<PackCache>> {
        self.cache.as_ref()
    }

    /// Bytes received from the store so far.
    pub fn downloaded_bytes(&self) -> u64 {
        self.downloaded.load(Ordering::Relaxed)
    }

    /// Bytes taken from the pack cache (and verified) so far.
    pub fn cached_bytes(&self) -> u64 {
        self.from_cache.load(Ordering::Relaxed)
    }

    /// Counts bytes a caller took from the pack cache and verified.
    pub fn note_cached(&self, bytes: u64) {
        self.from_cache.fetch_add(bytes, Ordering::Relaxed);
    }

    fn url(&self, pack: &PackId) -> Option<String> {
        self.urls.read().expect("url map lock").get(pack).cloned()
    }

    /// Downloads a whole pack.
    pub async fn get(&self, pack: &PackId) -> Result<Bytes, FetchError> {
        let bytes = self
            .with_url(pack, |url| async move {
                self.transfer.get(&url, &self.buffers).await
            })
            .await?;
        self.downloaded
            .fetch_add(bytes.len() as u64, Ordering::Relaxed);
        Ok(bytes)
    }

    /// Downloads `len` bytes of a pack from `offset`.
    pub async fn get_range(
        &self,
        pack: &PackId,
        offset: u64,
        len: u64,
    ) -> Result<Bytes, FetchError> {
        let bytes = self
            .with_url(pack, |url| async move {
                self.transfer
                    .get_range(&url, offset, len, &self.buffers)
                    .await
            })
            .await?;
        self.downloaded
            .fetch_add(bytes.len() as u64, Ordering::Relaxed);
        Ok(bytes)
    }

    async fn with_url<T, F, Fut>(&self, pack: &PackId, op: F) -> Result<T, FetchError>
    where
        F: Fn(String) -> Fut,
        Fut: Future<Output = Result<T, TransferError>>,
    {
        loop {
            let url = self
                .url(pack)
                .ok_or_else(|| FetchError::NoUrl { pack: pack.clone() })?;
            match op(url.clone()).await {
                Ok(value) => return Ok(value),
                Err(TransferError::Forbidden { url: shown }) => {
                    if !self.refresh(pack, &url).await? {
                        let source = TransferError::Forbidden { url: shown };
                        return Err(FetchError::Transfer {
                            pack: pack.clone(),
                            source,
                        });
                    }
                }
                Err(TransferError::NotFound { .. }) => {
                    return Err(FetchError::Missing { pack: pack.clone() });
                }
                Err(source) => {
                    return Err(FetchError::Transfer {
                        pack: pack.clone(),
                        source,
                    });
                }
            }
        }
    }

    /// Gets fresh URLs after `used` was refused. True when `pack` now has a
    /// different URL to try.
    async fn refresh(&self, pack: &PackId, used: &str) -> Result<bool, FetchError> {
        let mut refreshes = self.refreshes.lock().await;
        if self.url(pack).is_some_and(|current| current != used) {
            // Another download refreshed while this one waited for the lock.
            return Ok(true);
        }
        if *refreshes >= MAX_URL_REFRESHES {
            return Ok(false);
        }
        *refreshes += 1;
        tracing::info!(%pack, "the store refused a signed URL (expired?); asking for fresh ones");
        let manifest = self
            .source
            .restore_manifest(self.request.clone())
            .await
            .map_err(FetchError::Refresh)?;
        let mut urls = self.urls.write().expect("url map lock");
        for location in manifest.packs {
            if let Ok(id) = location.pack_id.parse::<PackId>() {
                urls.insert(id, location.url);
            }
        }
        Ok(urls.get(pack).is_some_and(|current| current != used))
    }
}

/// A whole META pack, checked ([`open_whole_pack`]), with its index: from
/// the pack cache when a piece holds it and passes the checks, else from the
/// store (and then put into the cache).
pub async fn fetch_whole_pack(
    fetcher: &PackFetcher<'_>,
    info: &PackInfo,
    keys: &Arc<TenantKeys>,
) -> Result<(Bytes, PackIndex), IndexError> {
    let opened = {
        let (owned, keys) = (info.clone(), keys.clone());
        from_cache(fetcher, &info.id, 0, info.size, move |bytes| {
            open_whole_pack(&owned, bytes, &keys)
        })
        .await
    };
    if let Some((index, bytes)) = opened {
        return Ok((Bytes::from(bytes), index));
    }
    let bytes = fetcher.get(&info.id).await?;
    let cache = fetcher.pack_cache().cloned();
    let (info, keys) = (info.clone(), keys.clone());
    let opened = blocking(move || {
        let index = open_whole_pack(&info, &bytes, &keys)?;
        if let Some(cache) = cache {
            cache.insert(&info.id, 0, &bytes);
        }
        Ok::<_, CorruptPack>((bytes, index))
    })
    .await?;
    Ok(opened)
}

/// Checks a whole downloaded pack against its manifest entry and opens its index.
pub fn open_whole_pack(
    info: &PackInfo,
    bytes: &[u8],
    keys: &TenantKeys,
) -> Result<PackIndex, CorruptPack> {
    check_digest(info, bytes)?;
    open_pack_index(info, bytes, keys)
}

/// Checks that a whole pack has its declared size and hashes to its id.
pub fn check_digest(info: &PackInfo, bytes: &[u8]) -> Result<(), CorruptPack> {
    let corrupt = |reason: String| CorruptPack {
        pack: info.id.clone(),
        reason,
    };
    if bytes.len() as u64 != info.size {
        return Err(corrupt(format!(
            "it is {} bytes, expected {}",
            bytes.len(),
            info.size
        )));
    }
    let digest: [u8; 32] = Sha256::digest(bytes).into();
    if digest != info.id.digest() {
        return Err(corrupt("its bytes do not hash to its id".into()));
    }
    Ok(())
}

/// Checks a whole pack's header and trailer against the manifest and opens
/// its index (without hashing the pack; see [`check_digest`]).
pub fn open_pack_index(
    info: &PackInfo,
    bytes: &[u8],
    keys: &TenantKeys,
) -> Result<PackIndex, CorruptPack> {
    let corrupt = |reason: String| CorruptPack {
        pack: info.id.clone(),
        reason,
    };
    if bytes.len() as u64 != info.size {
        return Err(corrupt(format!(
            "it is {} bytes, expected {}",
            bytes.len(),
            info.size
        )));
    }
    check_header(info, bytes)?;
    let tail = &bytes[bytes.len().saturating_sub(PACK_TRAILER_LEN)..];
    let (offset, length) = check_trailer(info, tail)?;
    let sealed = &bytes[offset as usize..(offset + u64::from(length)) as usize];
    PackIndex::open(keys, &info.id, info.kind, offset, sealed).map_err(|e| corrupt(e.to_string()))
}

/// Reads a pack's trailer with one ranged GET and checks it against the
/// manifest: the cheapest proof that the whole object is in the store.
pub async fn check_trailer_in_store(
    fetcher: &PackFetcher<'_>,
    info: &PackInfo,
) -> Result<(), IndexError> {
    let at = info
        .size
        .checked_sub(PACK_TRAILER_LEN as u64)
        .ok_or_else(|| CorruptPack {
            pack: info.id.clone(),
            reason: format!("{} bytes is too small for a pack", info.size),
        })?;
    let tail = fetcher
        .get_range(&info.id, at, PACK_TRAILER_LEN as u64)
        .await?;
    check_trailer(info, &tail)?;
    Ok(())
}

fn check_header(info: &PackInfo, header: &[u8]) -> Result<(), CorruptPack> {
    let kind = parse_pack_header(&info.id, header).map_err(|e| CorruptPack {
        pack: info.id.clone(),
        reason: e.to_string(),
    })?;
    if kind != info.kind {
        return Err(CorruptPack {
            pack: info.id.clone(),
            reason: format!("it is a {kind} pack but the manifest says {}", info.kind),
        });
    }
    Ok(())
}

fn check_trailer(info: &PackInfo, tail: &[u8]) -> Result<(u64, u32), CorruptPack> {
    let corrupt = |reason: String| CorruptPack {
        pack: info.id.clone(),
        reason,
    };
    let (offset, length) =
        parse_trailer(&info.id, info.size, tail).map_err(|e| corrupt(e.to_string()))?;
    if info.index_length != 0 && (offset, length) != (info.index_offset, info.index_length) {
        return Err(corrupt(format!(
            "its trailer puts the index at {offset}+{length}, the manifest at {}+{}",
            info.index_offset, info.index_length
        )));
    }
    Ok((offset, length))
}

/// What went wrong reading a DATA pack's index.
#[derive(Debug, thiserror::Error)]
pub enum IndexError {
    #[error(transparent)]
    Fetch(#[from] FetchError),
    #[error(transparent)]
    Corrupt(#[from] CorruptPack),
}

/// Reads a pack's index with ranged GETs: the header, then the index with
/// the trailer behind it.
pub async fn fetch_index(
    fetcher: &PackFetcher<'_>,
    info: &PackInfo,
    keys: &Arc<TenantKeys>,
) -> Result<PackIndex, IndexError> {
    let corrupt = |reason: String| CorruptPack {
        pack: info.id.clone(),
        reason,
    };
    let trailer_at = info
        .size
        .checked_sub(PACK_TRAILER_LEN as u64)
        .filter(|&at| at >= PACK_HEADER_LEN as u64)
        .ok_or_else(|| corrupt(format!("{} bytes is too small for a pack", info.size)))?;
    let index_offset = if info.index_length != 0 {
        info.index_offset
    } else {
        let tail = fetcher
            .get_range(&info.id, trailer_at, PACK_TRAILER_LEN as u64)
            .await?;
        check_trailer(info, &tail)?.0
    };
    if index_offset >= trailer_at {
        return Err(corrupt(format!(
            "its index offset {index_offset} lies outside its {} bytes",
            info.size
        ))
        .into());
    }
    if info.index_length != 0
        && let Some(index) = cached_index(fetcher, info, keys).await
    {
        return Ok(index);
    }
    let (header, index_and_tail) = futures::try_join!(
        fetcher.get_range(&info.id, 0, PACK_HEADER_LEN as u64),
        fetcher.get_range(&info.id, index_offset, info.size - index_offset),
    )?;
    check_header(info, &header)?;
    let index = open_index_and_tail(info, keys, index_offset, &index_and_tail)?;
    if let Some(cache) = fetcher.pack_cache() {
        let (cache, pack) = (cache.clone(), info.id.clone());
        blocking(move || cache.insert(&pack, index_offset, &index_and_tail)).await;
    }
    Ok(index)
}

/// A DATA pack's index from the pack cache, if a piece holds the index and
/// trailer at the manifest's offset and the index authenticates. The header
/// is not needed: the index's AEAD binds the pack kind, and a blob's own
/// checks do the rest.
async fn cached_index(
    fetcher: &PackFetcher<'_>,
    info: &PackInfo,
    keys: &Arc<TenantKeys>,
) -> Option<PackIndex> {
    let (owned, keys) = (info.clone(), keys.clone());
    from_cache(
        fetcher,
        &info.id,
        info.index_offset,
        info.size,
        move |bytes| open_index_and_tail(&owned, &keys, owned.index_offset, bytes),
    )
    .await
    .map(|(index, _)| index)
}

/// `open` applied to the cached piece that holds `[start, end)` of `pack`,
/// with the piece's bytes; None when no piece holds the range or the bytes
/// fail `open` (then the piece is dropped, and the caller goes to the store).
async fn from_cache<T: Send + 'static>(
    fetcher: &PackFetcher<'_>,
    pack: &PackId,
    start: u64,
    end: u64,
    open: impl FnOnce(&[u8]) -> Result<T, CorruptPack> + Send + 'static,
) -> Option<(T, Vec<u8>)> {
    let cache = fetcher.pack_cache()?.clone();
    let pack = pack.clone();
    let opened = blocking(move || {
        let (piece, bytes) = cache.get(&pack, start, end)?;
        match open(&bytes) {
            Ok(opened) => Some((opened, bytes)),
            Err(e) => {
                cache.discard(&pack, piece, &e.reason);
                None
            }
        }
    })
    .await;
    if let Some((_, bytes)) = &opened {
        fetcher.note_cached(bytes.len() as u64);
    }
    opened
}

/// Opens a pack's index from the bytes `[index_offset, size)`: the sealed
/// index, then the trailer, which must agree with the manifest.
fn open_index_and_tail(
    info: &PackInfo,
    keys: &TenantKeys,
    index_offset: u64,
    index_and_tail: &[u8],
) -> Result<PackIndex, CorruptPack> {
    let corrupt = |reason: String| CorruptPack {
        pack: info.id.clone(),
        reason,
    };
    let split = index_and_tail
        .len()
        .checked_sub(PACK_TRAILER_LEN)
        .ok_or_else(|| corrupt("its index and trailer are too short".into()))?;
    let (offset, length) = check_trailer(info, &index_and_tail[split..])?;
    if offset != index_offset || split != length as usize {
        return Err(corrupt(
            "its trailer disagrees with the manifest about the index".into(),
        ));
    }
    PackIndex::open(keys, &info.id, info.kind, offset, &index_and_tail[..split])
        .map_err(|e| corrupt(e.to_string()))
}

/// Requests closer than this are merged (reading a gap beats a round trip).
pub const MAX_GAP: u64 = 256 << 10;
/// Largest merged request. Each response is held in memory (and copied once
/// while it is collected), so this times the parallel requests bounds the
/// download buffers: 8 MiB × 8 keeps a restore's peak well under 200 MiB.
pub const MAX_REQUEST: u64 = 8 << 20;

/// One ranged GET covering several blobs of a pack.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Span<T> {
    pub start: u64,
    pub end: u64,
    pub items: Vec<(u64, u64, T)>,
}

/// Merges `(offset, len, item)` ranges of one pack into requests: a gap below
/// `max_gap` is read through, and a request grows to at most `max_request`
/// bytes (one larger item gets a request of its own).
pub fn coalesce<T>(mut items: Vec<(u64, u64, T)>, max_gap: u64, max_request: u64) -> Vec<Span<T>> {
    items.sort_by_key(|(offset, _, _)| *offset);
    let mut spans: Vec<Span<T>> = Vec::new();
    for (offset, len, item) in items {
        let end = offset + len;
        match spans.last_mut() {
            Some(span)
                if offset >= span.start
                    && offset.saturating_sub(span.end) < max_gap
                    && end.max(span.end) - span.start <= max_request =>
            {
                span.end = span.end.max(end);
                span.items.push((offset, len, item));
            }
            _ => spans.push(Span {
                start: offset,
                end,
                items: vec![(offset, len, item)],
            }),
        }
    }
    spans
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn near_ranges_merge_and_far_or_large_ones_do_not() {
        let items = vec![
            (600, 10, 'c'),
            (0, 100, 'a'),
            (200, 50, 'b'),
            (1_000_000, 5, 'd'),
        ];
        let spans = coalesce(items, 500, 4096);
        assert_eq!(spans.len(), 2);
        assert_eq!((spans[0].start, spans[0].end), (0, 610));
        let order: Vec<char> = spans[0].items.iter().map(|i| i.2).collect();
        assert_eq!(order, ['a', 'b', 'c']);
        assert_eq!((spans[1].start, spans[1].end), (1_000_000, 1_000_005));

        let big = coalesce(
            vec![(0, 3000, 1), (3000, 3000, 2), (6000, 10_000, 3)],
            500,
            4096,
        );
        let sizes: Vec<u64> = big.iter().map(|s| s.end - s.start).collect();
        assert_eq!(
            sizes,
            [3000, 3000, 10_000],
            "no request grows past the limit unless one item is larger"
        );
    }

    #[test]
    fn the_same_range_twice_stays_in_one_request() {
        let spans = coalesce(vec![(16, 40, 1), (16, 40, 2)], MAX_GAP, MAX_REQUEST);
        assert_eq!(spans.len(), 1);
        assert_eq!(spans[0].items.len(), 2);
    }
}
