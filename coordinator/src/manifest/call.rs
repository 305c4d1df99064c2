//! How the model is called: `[model] inputs` (the tensors `forward` takes,
//! in order, each with its source and dtype) and `dtype` (reduced
//! precision), and `[output] select`, `pooling`, `normalize` and `vector`
//! (which outputs are written, and how). The names of `forward`'s
//! parameters are read from the TorchScript archive and checked against the
//! inputs; when the coordinator is built with libtorch, [`super::probe`]
//! then runs the model on two sample rows to check what it returns.

use super::schema::{InputSetting, Manifest, SelectOne, SelectSetting};
use super::Problems;
use batchfleet_shared::message::{
    InputSource, ModelInput, Pooling, Precision, Selector, TensorType, MAX_MODEL_INPUTS,
    MAX_SELECTED_OUTPUTS,
};
use std::path::Path;

/// What the job's input provides the model.
#[derive(Debug, Clone, Copy)]
pub(super) struct Provided {
    /// Text tokenized by the job's tokenizer.
    pub(super) text: bool,
    /// Numeric columns (`[input] feature_columns`).
    pub(super) features: bool,
    /// Decoded images (`format = "files"`).
    pub(super) pixels: bool,
}

/// `[model] inputs`, checked against what the input provides.
pub(super) fn inputs(m: &Manifest, provided: Provided, problems: &mut Problems) -> Vec<ModelInput> {
    let key = "[model] inputs";
    let settings = &m.model.inputs;
    if settings.len() > MAX_MODEL_INPUTS {
        problems.add(
            key,
            format!(
                "lists {} inputs; a model takes at most {MAX_MODEL_INPUTS}",
                settings.len()
            ),
        );
        return Vec::new();
    }
    let mut out: Vec<ModelInput> = Vec::with_capacity(settings.len());
    for (k, setting) in settings.iter().enumerate() {
        let (name, source, dtype) = match setting {
            InputSetting::Source(s) => (None, s.as_str(), None),
            InputSetting::Table(t) => (t.name.as_deref(), t.source.as_str(), t.dtype.as_deref()),
        };
        let Some(source) = InputSource::from_name(source) else {
            problems.add(
                key,
                format!(
                    "input {k}: source \"{source}\" is not one of {}",
                    InputSource::listed()
                ),
            );
            continue;
        };
        let dtype = match dtype {
            None if source.is_token() => TensorType::Int64,
            None => TensorType::Float32,
            Some(d) => match TensorType::from_name(d) {
                Some(t) => t,
                None => {
                    problems.add(
                        key,
                        format!(
                            "input {k}: dtype \"{d}\" is not one of {}",
                            TensorType::listed()
                        ),
                    );
                    continue;
                }
            },
        };
        if source.is_token() && dtype.is_float() {
            problems.add(
                key,
                format!(
                    "input {k}: {} are token ids or flags; give them an integer dtype (int64 or int32)",
                    source.as_str()
                ),
            );
        }
        let name = name.unwrap_or(source.as_str()).to_owned();
        if name.is_empty() || out.iter().any(|i| i.name == name) {
            problems.add(
                key,
                format!("input {k}: name \"{name}\" must be non-empty and name one parameter once"),
            );
        }
        let missing = match source {
            s if s.is_token() && !provided.text => {
                Some("comes from the tokenizer: set [input] text_column and [model] tokenizer")
            }
            InputSource::Features if !provided.features => {
                Some("comes from numeric columns: list them in [input] feature_columns")
            }
            InputSource::Pixels if !provided.pixels => {
                Some("comes from image files: use [input] format = \"files\" with [preprocess]")
            }
            InputSource::Features if provided.pixels => {
                Some("is for table input; images are \"pixels\"")
            }
            _ => None,
        };
        if let Some(why) = missing {
            problems.add(
                key,
                format!("input {k} ({name}): source \"{}\" {why}", source.as_str()),
            );
        }
        out.push(ModelInput {
            name,
            source,
            dtype,
        });
    }
    if provided.text && !out.is_empty() && !out.iter().any(|i| i.source.is_token()) {
        problems.add(
            key,
            "takes nothing from the tokenizer, yet the job has [model] tokenizer; add \"input_ids\" (and \"attention_mask\"), or remove the tokenizer".into(),
        );
    }
    if provided.text && provided.features && !out.iter().any(|i| i.source == InputSource::Features)
    {
        problems.add(
            "[input] feature_columns",
            "beside text_column feed the model only through [model] inputs: add { source = \"features\" } where forward takes them, or copy the columns to the output with [output] include_columns instead".into(),
        );
    }
    out
}

/// `[model] dtype`: `bfloat16` or `float16`.
pub(super) fn dtype(m: &Manifest, problems: &mut Problems) -> Option<Precision> {
    precision("[model] dtype", m.model.dtype.as_deref(), problems)
}

/// A `dtype` setting (`field`): `bfloat16` or `float16`; `None` for
/// `float32`, unset (as saved) or a name that is neither (a problem).
pub(super) fn precision(
    field: &str,
    dtype: Option<&str>,
    problems: &mut Problems,
) -> Option<Precision> {
    let d = dtype?;
    if d == "float32" {
        return None;
    }
    let precision = Precision::from_name(d);
    if precision.is_none() {
        problems.add(
            field,
            format!("\"{d}\" is not bfloat16, float16 or float32 (the default: as saved)"),
        );
    }
    precision
}

/// `[output] select`, `pooling` and `normalize` (what the model's call
/// writes) and the `vector` column's fit with the other output options.
pub(super) struct Outputs {
    pub(super) select: Vec<Selector>,
    pub(super) pooling: Option<Pooling>,
    pub(super) normalize: bool,
}

/// Checks the output options that shape what is written.
pub(super) fn outputs(m: &Manifest, text: bool, problems: &mut Problems) -> Outputs {
    let out = &m.output;
    let one = |s: &SelectOne, problems: &mut Problems| match s {
        SelectOne::Name(n) if n.is_empty() => {
            problems.add(
                "[output] select",
                "is an empty name; give the key of a returned dict".into(),
            );
            None
        }
        SelectOne::Name(n) => Some(Selector::Name(n.clone())),
        SelectOne::Index(i) if (0..=i64::from(u16::MAX)).contains(i) => {
            Some(Selector::Index(*i as u32))
        }
        SelectOne::Index(i) => {
            problems.add(
                "[output] select",
                format!("{i} is not a position in a returned tuple (0, 1, …)"),
            );
            None
        }
    };
    let select: Vec<Selector> = match &out.select {
        None => Vec::new(),
        Some(SelectSetting::Name(n)) => one(&SelectOne::Name(n.clone()), problems)
            .into_iter()
            .collect(),
        Some(SelectSetting::Index(i)) => one(&SelectOne::Index(*i), problems).into_iter().collect(),
        Some(SelectSetting::Many(list)) => {
            if list.is_empty() || list.len() > MAX_SELECTED_OUTPUTS {
                problems.add(
                    "[output] select",
                    format!(
                        "lists {} outputs; select 1 to {MAX_SELECTED_OUTPUTS}",
                        list.len()
                    ),
                );
            }
            let picked: Vec<Selector> = list.iter().filter_map(|s| one(s, problems)).collect();
            for (k, s) in picked.iter().enumerate() {
                if picked[..k].contains(s) {
                    problems.add("[output] select", format!("selects {s} twice"));
                }
            }
            picked
        }
    };
    let pooling = out.pooling.as_deref().and_then(|name| {
        let pooling = Pooling::from_name(name);
        if pooling.is_none() {
            problems.add(
                "[output] pooling",
                format!("\"{name}\" is not \"mean\" or \"cls\""),
            );
        }
        pooling
    });
    if pooling == Some(Pooling::Mean) && !text {
        problems.add(
            "[output] pooling",
            "= \"mean\" averages over the tokens the attention mask marks: it needs text input ([input] text_column); use \"cls\" for the first position".into(),
        );
    }
    if let Some(name) = &out.vector {
        let clash =
            name.is_empty() || name == "id" || out.include_columns.iter().any(|c| c == name);
        if clash {
            problems.add(
                "[output] vector",
                format!("\"{name}\" cannot name the vector column: it must be non-empty, not id, and not a copied column"),
            );
        }
        for (set, what) in [
            (out.labels.is_some(), "labels"),
            (out.argmax, "argmax"),
            (out.top_k.is_some(), "top_k"),
            (!out.columns.is_empty(), "columns"),
            (out.scores.is_some(), "scores"),
        ] {
            if set {
                problems.add(
                    "[output] vector",
                    format!("writes the output as one vector column; {what} names or ranks separate score columns — remove one of them"),
                );
            }
        }
        if select.len() > 1 {
            problems.add(
                "[output] vector",
                "holds one output; select one tensor for it (or leave vector out to write the selected outputs as columns)".into(),
            );
        }
    }
    if select.len() > 1 && (out.labels.is_some() || out.argmax || out.top_k.is_some()) {
        problems.add(
            "[output] select",
            "picks several outputs; labels, argmax and top_k rank the classes of one — select the logits alone".into(),
        );
    }
    Outputs {
        select,
        pooling,
        normalize: out.normalize,
    }
}

/// Checks `forward`'s parameters, read from the archive, against the inputs
/// the job passes: each named input is the parameter at its position, and
/// any parameter after them has a default. A model whose code this reader
/// does not follow is left to the probe and the workers.
pub(super) fn check_parameters(
    model_path: &Path,
    inputs: &[ModelInput],
    text: bool,
    problems: &mut Problems,
) {
    let Ok(Some(params)) = batchfleet_shared::model_file::forward_params(model_path) else {
        return;
    };
    let shown = params
        .iter()
        .map(|p| p.name.as_str())
        .collect::<Vec<_>>()
        .join(", ");
    let required = params.iter().filter(|p| !p.has_default).count();
    if inputs.is_empty() {
        let (passed, call) = if text {
            (2, "forward(input_ids, attention_mask)")
        } else {
            (1, "forward(features) with one float32 tensor")
        };
        if params.len() < passed || required > passed {
            problems.add(
                "[model] inputs",
                format!(
                    "{} has forward({shown}), but this job calls {call}; list what each parameter takes in [model] inputs, e.g. inputs = [\"input_ids\", \"attention_mask\", \"token_type_ids\"]",
                    model_path.display()
                ),
            );
        }
        return;
    }
    // Tracing may number a parameter's name (`attention_mask_1`): the
    // number does not make it another parameter.
    let same = |param: &str, name: &str| {
        param == name
            || param
                .strip_prefix(name)
                .and_then(|rest| rest.strip_prefix(['_', '.']))
                .is_some_and(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
    };
    for (k, input) in inputs.iter().enumerate() {
        match params.get(k) {
            Some(p) if same(&p.name, &input.name) => {}
            Some(p) => problems.add(
                "[model] inputs",
                format!(
                    "input {k} is named \"{}\" but {}'s forward({shown}) has \"{}\" there; list the inputs in forward's order, naming each parameter (name = \"…\")",
                    input.name,
                    model_path.display(),
                    p.name
                ),
            ),
            None => problems.add(
                "[model] inputs",
                format!(
                    "lists {} inputs but {}'s forward({shown}) takes {}",
                    inputs.len(),
                    model_path.display(),
                    params.len()
                ),
            ),
        }
    }
    if let Some(p) = params[inputs.len().min(params.len())..]
        .iter()
        .find(|p| !p.has_default)
    {
        problems.add(
            "[model] inputs",
            format!(
                "{}'s forward({shown}) also needs \"{}\", which no input gives; add it to [model] inputs",
                model_path.display(),
                p.name
            ),
        );
    }
}

#[cfg(test)]
mod tests {
    use crate::manifest::testing::{problems, Fixture, GOOD};
    use batchfleet_shared::message::{InputSource, Pooling, Precision, Selector, TensorType};

    fn with(model: &str, output: &str) -> String {
        GOOD.replace(
            "path = \"model.pt\"",
            &format!("path = \"model.pt\"\n{model}"),
        )
        .replace("dir = \"out\"", &format!("dir = \"out\"\n{output}"))
    }

    #[test]
    fn inputs_select_and_vector_reach_the_task() {
        let fx = Fixture::new();
        let spec = fx
            .load(&with(
                "inputs = [{ name = \"x\", source = \"features\", dtype = \"float64\" }]\ndtype = \"bfloat16\"",
                "select = [\"emb\", 2]\nnormalize = true\npooling = \"cls\"",
            ))
            .unwrap();
        let m = &spec.task.model;
        assert_eq!(m.inputs.len(), 1);
        assert_eq!(
            (
                m.inputs[0].name.as_str(),
                m.inputs[0].source,
                m.inputs[0].dtype
            ),
            ("x", InputSource::Features, TensorType::Float64)
        );
        assert_eq!(m.dtype, Some(Precision::Bfloat16));
        assert_eq!(m.select, [Selector::Name("emb".into()), Selector::Index(2)]);
        assert_eq!((m.pooling, m.normalize), (Some(Pooling::Cls), true));
        let spec = fx.load(&with("", "vector = \"embedding\"")).unwrap();
        assert_eq!(spec.task.output.vector.as_deref(), Some("embedding"));
        // A plain manifest keeps the plain call (and so its job id).
        let plain = fx.load(GOOD).unwrap();
        assert!(plain.task.model.takes_plain_features());
        assert!(!plain.task.model.tf32);
        // TF32 reaches the task, and changes the outputs' numbers: a new job.
        let tf32 = fx.load(&with("tf32 = true", "")).unwrap();
        assert!(tf32.task.model.tf32);
        assert_ne!(tf32.job_id, plain.job_id);
        let off = fx.load(&with("tf32 = false", "")).unwrap();
        assert_eq!(off.job_id, plain.job_id, "the default, written out");
    }

    #[test]
    fn each_bad_call_setting_is_named() {
        let fx = Fixture::new();
        let err = problems(fx.load(&with(
            "inputs = [\"input_ids\", { source = \"pictures\" }, { source = \"features\", dtype = \"int8\" }, { name = \"input_ids\", source = \"features\" }]\ndtype = \"float8\"",
            "",
        )));
        for want in [
            "[model] inputs: input 0 (input_ids): source \"input_ids\" comes from the tokenizer",
            "input 1: source \"pictures\" is not one of input_ids, attention_mask, token_type_ids, features, pixels",
            "input 2: dtype \"int8\" is not one of int64, int32, float32, float64",
            "input 3: name \"input_ids\" must be non-empty and name one parameter once",
            "[model] dtype: \"float8\" is not bfloat16, float16 or float32",
        ] {
            assert!(err.contains(want), "{want} not in {err}");
        }
        let err = problems(fx.load(&with(
            "",
            "vector = \"id\"\nargmax = true\nselect = [\"a\", \"a\"]\npooling = \"mean\"",
        )));
        for want in [
            "[output] select: selects \"a\" twice",
            "[output] pooling: = \"mean\" averages over the tokens the attention mask marks",
            "[output] vector: \"id\" cannot name the vector column",
            "[output] vector: writes the output as one vector column; argmax",
            "[output] vector: holds one output",
            "[output] select: picks several outputs; labels, argmax and top_k",
        ] {
            assert!(err.contains(want), "{want} not in {err}");
        }
        let err = problems(fx.load(&with("", "select = -1\npooling = \"max\"")));
        assert!(err.contains("-1 is not a position"), "{err}");
        assert!(err.contains("\"max\" is not \"mean\" or \"cls\""), "{err}");
    }
}
