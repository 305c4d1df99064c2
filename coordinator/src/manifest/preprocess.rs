//! `[preprocess]`: how the image files of `files` input become a model input
//! — size, channels, and the per-channel mean and standard deviation. The
//! section is required for `files` input and refused for tables.

use super::schema::{InputFormat, Manifest, PreprocessSection};
use super::Problems;
use batchfleet_shared::message::ImageSpec;

/// The image preprocessing of a `files` job (`None` for tables, or when the
/// section has problems).
pub(super) fn check(m: &Manifest, problems: &mut Problems) -> Option<ImageSpec> {
    let files_input = m.input.format == InputFormat::Files;
    match (&m.preprocess, files_input) {
        (Some(p), true) => image_spec(p, problems),
        (None, true) => {
            problems.add(
                "[preprocess]",
                "is required for format = \"files\": give at least size = [height, width]".into(),
            );
            None
        }
        (Some(_), false) => {
            problems.add("[preprocess]", "applies to format = \"files\" only".into());
            None
        }
        (None, false) => None,
    }
}

/// The image preprocessing of `[preprocess]`, or problems.
fn image_spec(p: &PreprocessSection, problems: &mut Problems) -> Option<ImageSpec> {
    let mut ok = true;
    let (height, width) = match p.size.as_slice() {
        [h, w] if (1..=8192).contains(h) && (1..=8192).contains(w) => (*h, *w),
        _ => {
            problems.add(
                "[preprocess] size",
                format!("{:?} must be [height, width], each 1 to 8192", p.size),
            );
            ok = false;
            (1, 1)
        }
    };
    let channels = p.channels.unwrap_or(3);
    if channels != 1 && channels != 3 {
        problems.add(
            "[preprocess] channels",
            format!("{channels} must be 3 (RGB) or 1 (grey)"),
        );
        return None;
    }
    let per_channel =
        |field: &str, v: &Option<Vec<f32>>, default: f32, problems: &mut Problems| match v {
            None => Some(vec![default; channels as usize]),
            Some(v) if v.len() == channels as usize && v.iter().all(|x| x.is_finite()) => {
                Some(v.clone())
            }
            Some(v) => {
                problems.add(
                    field,
                    format!("{v:?} must hold {channels} finite number(s), one per channel"),
                );
                None
            }
        };
    let mean = per_channel("[preprocess] mean", &p.mean, 0.0, problems);
    let std = per_channel("[preprocess] std", &p.std, 1.0, problems);
    if std.as_ref().is_some_and(|s| s.iter().any(|x| *x <= 0.0)) {
        problems.add("[preprocess] std", "every value must be above 0".into());
        ok = false;
    }
    Some(ImageSpec {
        height,
        width,
        channels,
        mean: mean?,
        std: std?,
    })
    .filter(|_| ok)
}

#[cfg(test)]
mod tests {
    use crate::manifest::testing::{problems, Fixture, FILES, GOOD};
    use std::fs;

    #[test]
    fn files_input_problems_are_each_named() {
        let fx = Fixture::new();
        fs::create_dir_all(fx.dir.path().join("img")).unwrap();
        fs::write(fx.dir.path().join("img/1.png"), b"png").unwrap();
        fs::write(
            fx.dir.path().join("list.txt"),
            "img/1.png\nimg/nope.png\n../escape.png\n",
        )
        .unwrap();
        let bad = FILES
            .replace(
                "paths = [\"img/**/*.png\"]",
                "paths = [\"data/*.csv\"]\nlisting = \"list.txt\"\nid_column = \"id\"",
            )
            .replace("size = [8, 6]", "size = [8]")
            .replace("mean = [0.5, 0.5, 0.5]", "mean = [0.5]")
            .replace("std = [0.25, 0.25, 0.25]", "std = [0.25, 0.25, 0.0]");
        let err = problems(fx.load(&bad));
        for want in [
            "[input] listing:",
            "line 2:",
            "nope.png is not a file",
            "line 3:",
            "contains `..`",
            "[input] root:",
            "a.csv is not under",
            "[preprocess] size: [8] must be [height, width]",
            "[preprocess] mean: [0.5] must hold 3 finite number(s)",
            "[preprocess] std: every value must be above 0",
            "[input] id_column: and feature_columns do not apply to format = \"files\"",
        ] {
            assert!(err.contains(want), "{want} not in {err}");
        }
        // Tables need no [preprocess], and files need one.
        let err =
            problems(fx.load(&GOOD.replace("[model]", "[preprocess]\nsize = [1, 1]\n[model]")));
        assert!(
            err.contains("[preprocess]: applies to format = \"files\" only"),
            "{err}"
        );
        let start = FILES.find("[preprocess]").unwrap();
        let end = FILES.find("[model]").unwrap();
        let err = problems(fx.load(&(FILES[..start].to_owned() + &FILES[end..])));
        assert!(
            err.contains("[preprocess]: is required for format = \"files\""),
            "{err}"
        );
    }
}
