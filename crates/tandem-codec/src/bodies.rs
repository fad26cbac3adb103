//! Decoding of the baselines' composite bodies: FGBI's coded blocks and Gerofi's areas.

use crate::code::{area, block};
use crate::decoder::{bad, DecodeCtx};
use crate::format::PAGE;
use crate::runs;
use crate::DecodeError;

pub(crate) fn decode_blocks(
    i: usize,
    mask: u64,
    p: &[u8],
    done: &[u8],
    out: &mut [u8],
) -> Result<(), DecodeError> {
    let mut pos = 0;
    for b in (0..64).filter(|b| mask & (1 << b) != 0) {
        let tag = *p.get(pos).ok_or_else(|| bad(i, "block code truncated"))?;
        pos += 1;
        let dst = &mut out[b * 64..(b + 1) * 64];
        let take_len = |pos: &mut usize| -> Result<usize, DecodeError> {
            let l =
                runs::get_uleb(p, pos).ok_or_else(|| bad(i, "block length truncated"))? as usize;
            if p.len() - *pos < l {
                return Err(bad(i, "block payload truncated"));
            }
            Ok(l)
        };
        match tag {
            block::ZERO => dst.fill(0),
            block::RAW => {
                let s = p
                    .get(pos..pos + 64)
                    .ok_or_else(|| bad(i, "raw block truncated"))?;
                dst.copy_from_slice(s);
                pos += 64;
            }
            block::SPARSE => {
                let l = take_len(&mut pos)?;
                dst.fill(0);
                if !runs::apply(&p[pos..pos + l], 1, dst) {
                    return Err(bad(i, "malformed sparse block"));
                }
                pos += l;
            }
            block::WKDM => {
                let l = take_len(&mut pos)?;
                if !crate::wkdm::decompress(&p[pos..pos + l], dst) {
                    return Err(bad(i, "malformed WKdm block"));
                }
                pos += l;
            }
            block::EPOCH_REF => {
                let r = runs::get_uleb(p, &mut pos)
                    .ok_or_else(|| bad(i, "block reference truncated"))?;
                if r >= (i as u64) * 64 {
                    return Err(bad(
                        i,
                        format!("block reference {r} is not to an earlier page"),
                    ));
                }
                let r = r as usize;
                dst.copy_from_slice(&done[r * 64..(r + 1) * 64]);
            }
            t => return Err(bad(i, format!("unknown block code {t}"))),
        }
    }
    if pos != p.len() {
        return Err(bad(i, "trailing bytes after blocks"));
    }
    Ok(())
}

pub(crate) fn decode_areas(
    ctx: &DecodeCtx<'_>,
    i: usize,
    p: &[u8],
    done: &[u8],
    out: &mut [u8],
) -> Result<(), DecodeError> {
    const AREA: usize = 512;
    let mut pos = 0;
    for a in 0..PAGE / AREA {
        let tag = *p.get(pos).ok_or_else(|| bad(i, "area code truncated"))?;
        pos += 1;
        let dst = &mut out[a * AREA..(a + 1) * AREA];
        match tag {
            area::SAME => {}
            area::ZERO => dst.fill(0),
            area::RAW => {
                let s = p
                    .get(pos..pos + AREA)
                    .ok_or_else(|| bad(i, "raw area truncated"))?;
                dst.copy_from_slice(s);
                pos += AREA;
            }
            area::DELTA => {
                let kind = *p
                    .get(pos)
                    .ok_or_else(|| bad(i, "area reference truncated"))?;
                pos += 1;
                let page = runs::get_uleb(p, &mut pos)
                    .ok_or_else(|| bad(i, "area reference truncated"))?;
                let ra = *p
                    .get(pos)
                    .ok_or_else(|| bad(i, "area reference truncated"))?
                    as usize;
                pos += 1;
                if ra >= PAGE / AREA {
                    return Err(bad(i, format!("area index {ra}")));
                }
                let src: &[u8] = match kind {
                    1 if page < ctx.pages => {
                        &ctx.mirror[page as usize * PAGE..(page as usize + 1) * PAGE]
                    }
                    2 if page < i as u64 => &done[page as usize * PAGE..(page as usize + 1) * PAGE],
                    _ => {
                        return Err(bad(
                            i,
                            format!("area reference kind {kind} page {page} is invalid"),
                        ))
                    }
                };
                dst.copy_from_slice(&src[ra * AREA..(ra + 1) * AREA]);
                let l = runs::get_uleb(p, &mut pos)
                    .ok_or_else(|| bad(i, "area delta length truncated"))?
                    as usize;
                if p.len() - pos < l || !runs::apply(&p[pos..pos + l], 1, dst) {
                    return Err(bad(i, "malformed area delta"));
                }
                pos += l;
            }
            t => return Err(bad(i, format!("unknown area code {t}"))),
        }
    }
    if pos != p.len() {
        return Err(bad(i, "trailing bytes after areas"));
    }
    Ok(())
}
