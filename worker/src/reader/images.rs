//! Reads the records of a `files` work item: one image file per record,
//! decoded, converted, resized and normalised into a channels-first (CHW)
//! `f32` row — what torchvision's `ToTensor()` + `Normalize(mean, std)` give
//! on the same pixels.
//!
//! - Decoding: PNG, JPEG and WebP (the `image` crate); 16-bit images are
//!   reduced to 8 bits per channel; alpha is dropped.
//! - Channels: 3 = RGB (a grey image has its value in all three); 1 = grey
//!   (a colour image becomes `0.299 R + 0.587 G + 0.114 B`, computed on the
//!   0–1 values without rounding, as torchvision's tensor `Grayscale` does).
//! - Resizing: only when the image is not already `height × width`, with a
//!   triangle (bilinear) filter that widens when shrinking (antialiased), as
//!   PIL's `BILINEAR` does; the two may differ by a grey level here and there.
//!
//! A file that does not decode is a bad row (rejected or failing the item,
//! per `on_bad_row`); a file that is gone or changed size since planning is poison.

use crate::batch::{Batch, Reject};
use crate::error::ItemError;
use batchfleet_shared::message::{ImageSpec, OnBadRow};
use image::imageops::FilterType;
use image::DynamicImage;
use std::path::Path;

/// Where one item's files are.
#[derive(Debug, Clone, Copy)]
pub struct FileList<'a> {
    /// Folder the names are relative to.
    pub root: &'a str,
    /// Relative names (the records' ids).
    pub files: &'a [String],
    /// Sizes when planned.
    pub sizes: &'a [u64],
    /// 0-based position of the first file in the job.
    pub first_index: u64,
}

/// Reads and preprocesses every file of the item.
pub fn read_files(
    list: FileList<'_>,
    spec: &ImageSpec,
    on_bad_row: OnBadRow,
    io_error: impl Fn(&str, std::io::Error) -> ItemError,
) -> Result<Batch, ItemError> {
    let (c, h, w) = (
        spec.channels as usize,
        spec.height as usize,
        spec.width as usize,
    );
    if list.sizes.len() != list.files.len()
        || spec.mean.len() != c
        || spec.std.len() != c
        || !(c == 1 || c == 3)
    {
        return Err(ItemError::rejected(
            "the item's file list or preprocessing is inconsistent; the message is malformed",
        ));
    }
    let mut batch = Batch::with_capacity(c * h * w, list.files.len());
    batch.shape = vec![c, h, w];
    batch.file = list.root.to_owned();
    let mut row = vec![0f32; c * h * w];
    for (i, (name, planned)) in list.files.iter().zip(list.sizes).enumerate() {
        let path = Path::new(list.root).join(name);
        let shown = path.display().to_string();
        // Never more than the planned size (and one byte to see it grew):
        // the size comes from the plan, not from whatever the file holds now.
        let bytes = batchfleet_shared::source::Input::open(&path)
            .and_then(|i| {
                if batchfleet_shared::source::is_url(&path) {
                    i.read_all()
                } else {
                    i.read_range(0..planned.saturating_add(1))
                }
            })
            .map_err(|e| io_error(&shown, e))?;
        if bytes.len() as u64 != *planned {
            return Err(ItemError::poison(format!(
                "{shown} is no longer the {planned} bytes it was when the job was planned; the input changed under the job — restore it or start a new job"
            )));
        }
        let line = list.first_index + i as u64 + 1;
        match image::load_from_memory(&bytes) {
            Ok(img) => {
                to_chw(&img, spec, &mut row);
                batch.push_row(name, &row, line, (0, 0));
            }
            Err(e) => {
                let reason = format!("cannot decode the image: {e}");
                match on_bad_row {
                    OnBadRow::FailItem => {
                        return Err(ItemError::poison(format!("{shown}: {reason}")))
                    }
                    OnBadRow::Reject => batch.rejects.push(Reject {
                        file: shown,
                        line,
                        raw: name.clone(),
                        reason,
                        stage: "parse".into(),
                    }),
                }
            }
        }
    }
    Ok(batch)
}

/// Converts, resizes and normalises one image into `out` (`channels × height × width`).
pub fn to_chw(img: &DynamicImage, spec: &ImageSpec, out: &mut [f32]) {
    let (h, w) = (spec.height, spec.width);
    let rgb = spec.channels == 3 || img.color().has_color();
    let img = if rgb {
        DynamicImage::ImageRgb8(img.to_rgb8())
    } else {
        DynamicImage::ImageLuma8(img.to_luma8())
    };
    let img = if img.width() == w && img.height() == h {
        img
    } else {
        img.resize_exact(w, h, FilterType::Triangle)
    };
    let px = img.as_bytes();
    let plane = (h * w) as usize;
    let from = if rgb { 3 } else { 1 };
    if spec.channels == 1 && rgb {
        // Grey from colour, on the 0–1 values.
        for (p, slot) in out[..plane].iter_mut().enumerate() {
            let v = |k: usize| f32::from(px[p * 3 + k]) / 255.0;
            let grey = 0.299 * v(0) + 0.587 * v(1) + 0.114 * v(2);
            *slot = (grey - spec.mean[0]) / spec.std[0];
        }
        return;
    }
    for ch in 0..spec.channels as usize {
        let k = if from == 1 { 0 } else { ch };
        let (mean, std) = (spec.mean[ch], spec.std[ch]);
        for (p, slot) in out[ch * plane..(ch + 1) * plane].iter_mut().enumerate() {
            *slot = (f32::from(px[p * from + k]) / 255.0 - mean) / std;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use image::{GrayImage, Rgb, RgbImage, RgbaImage};

    fn spec(channels: u32, h: u32, w: u32) -> ImageSpec {
        ImageSpec {
            height: h,
            width: w,
            channels,
            mean: vec![0.5; channels as usize],
            std: vec![0.25; channels as usize],
        }
    }

    #[test]
    fn rgb_is_laid_out_channels_first_and_normalised() {
        let mut img = RgbImage::new(2, 1);
        img.put_pixel(0, 0, Rgb([255, 0, 51]));
        img.put_pixel(1, 0, Rgb([0, 255, 102]));
        let mut out = vec![0f32; 6];
        to_chw(&DynamicImage::ImageRgb8(img), &spec(3, 1, 2), &mut out);
        let n = |v: f32| (v / 255.0 - 0.5) / 0.25;
        assert_eq!(
            out,
            vec![n(255.0), n(0.0), n(0.0), n(255.0), n(51.0), n(102.0)]
        );
    }

    #[test]
    fn grey_and_alpha_sources_and_grey_models() {
        // A grey source fills all three channels; alpha is dropped.
        let grey = DynamicImage::ImageLuma8(GrayImage::from_pixel(2, 2, image::Luma([128])));
        let mut out = vec![0f32; 12];
        to_chw(&grey, &spec(3, 2, 2), &mut out);
        assert!(out.iter().all(|v| *v == (128.0 / 255.0 - 0.5) / 0.25));
        let rgba =
            DynamicImage::ImageRgba8(RgbaImage::from_pixel(2, 2, image::Rgba([10, 20, 30, 0])));
        to_chw(&rgba, &spec(3, 2, 2), &mut out);
        assert_eq!(out[0], (10.0 / 255.0 - 0.5) / 0.25);
        assert_eq!(out[8], (30.0 / 255.0 - 0.5) / 0.25);
        // A colour source for a one-channel model: 0.299 R + 0.587 G + 0.114 B.
        let colour = DynamicImage::ImageRgb8(RgbImage::from_pixel(1, 1, Rgb([255, 0, 0])));
        let mut one = vec![0f32; 1];
        to_chw(&colour, &spec(1, 1, 1), &mut one);
        assert!((one[0] - (0.299 - 0.5) / 0.25).abs() < 1e-6, "{}", one[0]);
    }

    #[test]
    fn other_sizes_are_resized_smoothly() {
        // A flat image stays flat; a left-to-right ramp stays a ramp.
        let flat = DynamicImage::ImageRgb8(RgbImage::from_pixel(37, 23, Rgb([200, 100, 0])));
        let mut out = vec![0f32; 3 * 8 * 8];
        to_chw(&flat, &spec(3, 8, 8), &mut out);
        assert!(out[..64].iter().all(|v| *v == (200.0 / 255.0 - 0.5) / 0.25));
        let ramp = RgbImage::from_fn(64, 16, |x, _| Rgb([(x * 4) as u8, 0, 0]));
        to_chw(&DynamicImage::ImageRgb8(ramp), &spec(3, 8, 8), &mut out);
        let first_row = &out[..8];
        assert!(first_row.windows(2).all(|p| p[0] < p[1]), "{first_row:?}");
        // Pixel 0 of 8 covers source columns 0..8 (values 0..28): about 14.
        let v0 = (first_row[0] * 0.25 + 0.5) * 255.0;
        assert!((8.0..20.0).contains(&v0), "{v0}");
    }

    #[test]
    fn undecodable_files_are_bad_rows_and_changed_files_poison() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().to_string_lossy().into_owned();
        let mut png = Vec::new();
        DynamicImage::ImageRgb8(RgbImage::from_pixel(4, 4, Rgb([1, 2, 3])))
            .write_to(&mut std::io::Cursor::new(&mut png), image::ImageFormat::Png)
            .unwrap();
        std::fs::create_dir(dir.path().join("a")).unwrap();
        std::fs::write(dir.path().join("a/ok.png"), &png).unwrap();
        std::fs::write(dir.path().join("bad.png"), b"not an image").unwrap();
        let files = vec!["a/ok.png".to_owned(), "bad.png".to_owned()];
        let sizes = vec![png.len() as u64, 12];
        let list = FileList {
            root: &root,
            files: &files,
            sizes: &sizes,
            first_index: 10,
        };
        let io = |p: &str, e: std::io::Error| ItemError::transient(format!("{p}: {e}"));
        let b = read_files(list, &spec(3, 4, 4), OnBadRow::Reject, io).unwrap();
        assert_eq!(
            (b.rows(), b.id(0), b.row_shape()),
            (1, "a/ok.png", vec![3, 4, 4])
        );
        assert_eq!(b.rejects.len(), 1);
        assert_eq!(
            (b.rejects[0].line, b.rejects[0].raw.as_str()),
            (12, "bad.png")
        );
        assert!(b.rejects[0].reason.starts_with("cannot decode the image"));
        let e = read_files(list, &spec(3, 4, 4), OnBadRow::FailItem, io).unwrap_err();
        assert!(
            e.message.contains("bad.png: cannot decode"),
            "{}",
            e.message
        );
        let wrong = vec![png.len() as u64 + 1, 12];
        let e = read_files(
            FileList {
                sizes: &wrong,
                ..list
            },
            &spec(3, 4, 4),
            OnBadRow::Reject,
            io,
        )
        .unwrap_err();
        assert!(
            e.message.contains("the input changed under the job"),
            "{}",
            e.message
        );
    }
}
