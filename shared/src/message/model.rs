//! The model call: which model (path and digest), on which device and in
//! which precision, what its `forward` takes and which of its outputs are
//! written, pooled or normalised.

use serde::{Deserialize, Serialize};

/// The manifest's words for the values of a small enum of the model call:
/// `as_str`, `from_name` and `listed` (every name, for messages).
macro_rules! manifest_names {
    ($ty:ident { $($name:literal => $variant:ident),* $(,)? }) => {
        impl $ty {
            /// The manifest's name of the value.
            pub fn as_str(self) -> &'static str {
                match self {
                    $($ty::$variant => $name,)*
                }
            }

            /// The value a manifest name stands for.
            pub fn from_name(name: &str) -> Option<Self> {
                match name {
                    $($name => Some($ty::$variant),)*
                    _ => None,
                }
            }

            /// Every name, in order, comma-separated.
            pub fn listed() -> String {
                [$($name),*].join(", ")
            }
        }
    };
}

/// A TorchScript model, identified by path and content digest, and how it
/// is called: which tensors its `forward` takes, in which precision it runs,
/// and which of its outputs are written. The call fields are serialized only
/// when set, so a plain model keeps its encoding (and its jobs their ids).
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct ModelRef {
    /// Absolute path of the TorchScript file.
    pub path: String,
    /// SHA-256 of the file (hex); the worker refuses a file that does not match.
    pub sha256: String,
    /// `cpu`, `cuda` or `cuda:N`.
    pub device: String,
    /// `forward`'s arguments in order (`[model] inputs`); empty: the
    /// default for the input — `forward(features)` (or pixels), or
    /// `forward(input_ids, attention_mask)` for text.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub inputs: Vec<ModelInput>,
    /// Reduced precision the model runs in (`[model] dtype`); `None`: as saved.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dtype: Option<Precision>,
    /// The outputs written (`[output] select`), for a model returning a
    /// tuple, a list or a dict of tensors; empty: its one tensor.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub select: Vec<Selector>,
    /// How a `[rows, L, D]` output becomes `[rows, D]` (`[output] pooling`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pooling: Option<Pooling>,
    /// L2-normalise each selected output's rows (`[output] normalize`).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub normalize: bool,
    /// CUDA matrix multiplications may run in TF32 (`[model] tf32`).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub tf32: bool,
}

impl ModelRef {
    /// A model called the default way: one input, one output, as saved.
    pub fn plain(
        path: impl Into<String>,
        sha256: impl Into<String>,
        device: impl Into<String>,
    ) -> Self {
        Self {
            path: path.into(),
            sha256: sha256.into(),
            device: device.into(),
            inputs: Vec::new(),
            dtype: None,
            select: Vec::new(),
            pooling: None,
            normalize: false,
            tf32: false,
        }
    }

    /// Whether `forward` takes one `float32` tensor of the rows' features
    /// (or pixels) in the saved precision: the default call.
    pub fn takes_plain_features(&self) -> bool {
        self.dtype.is_none()
            && match self.inputs.as_slice() {
                [] => true,
                [one] => {
                    matches!(one.source, InputSource::Features | InputSource::Pixels)
                        && one.dtype == TensorType::Float32
                }
                _ => false,
            }
    }

    /// Whether some input is the tokenizer's `token_type_ids`.
    pub fn wants_type_ids(&self) -> bool {
        self.inputs
            .iter()
            .any(|i| i.source == InputSource::TokenTypeIds)
    }
}

/// One argument of the model's `forward`: its name (the parameter's, checked
/// at validation), where its values come from and the tensor type it takes.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct ModelInput {
    /// The `forward` parameter's name.
    pub name: String,
    /// Where the values come from.
    pub source: InputSource,
    /// The tensor's element type.
    pub dtype: TensorType,
}

/// Where a model input's values come from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum InputSource {
    /// The tokenizer's ids, `[rows, L]`, padded per mini-batch.
    InputIds,
    /// 1 on real tokens, 0 on padding, `[rows, L]`.
    AttentionMask,
    /// The tokenizer's segment ids, `[rows, L]` (0 on padding).
    TokenTypeIds,
    /// The numeric columns (`[input] feature_columns`), `[rows, F]`.
    Features,
    /// The decoded images, `[rows, C, H, W]`.
    Pixels,
}

manifest_names!(InputSource {
    "input_ids" => InputIds,
    "attention_mask" => AttentionMask,
    "token_type_ids" => TokenTypeIds,
    "features" => Features,
    "pixels" => Pixels,
});

impl InputSource {
    /// Whether the tokenizer makes it.
    pub fn is_token(self) -> bool {
        matches!(
            self,
            InputSource::InputIds | InputSource::AttentionMask | InputSource::TokenTypeIds
        )
    }
}

/// A model input's element type.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TensorType {
    /// `torch.int64` (`long`).
    Int64,
    /// `torch.int32`.
    Int32,
    /// `torch.float32`; in the model's `[model] dtype` when that is set.
    Float32,
    /// `torch.float64` (`double`).
    Float64,
}

manifest_names!(TensorType {
    "int64" => Int64,
    "int32" => Int32,
    "float32" => Float32,
    "float64" => Float64,
});

impl TensorType {
    /// Whether it is a floating-point type.
    pub fn is_float(self) -> bool {
        matches!(self, TensorType::Float32 | TensorType::Float64)
    }
}

/// Reduced precision a model runs in (`[model] dtype`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Precision {
    /// `torch.bfloat16`.
    Bfloat16,
    /// `torch.float16` (half).
    Float16,
}

manifest_names!(Precision {
    "bfloat16" => Bfloat16,
    "float16" => Float16,
});

/// One output of a model returning several (`[output] select`): a dict key,
/// or a position in a tuple or list.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Selector {
    /// A key of a returned dict.
    Name(String),
    /// A position in a returned tuple or list (from 0).
    Index(u32),
}

impl std::fmt::Display for Selector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Selector::Name(n) => write!(f, "{n:?}"),
            Selector::Index(i) => write!(f, "{i}"),
        }
    }
}

impl Selector {
    /// The prefix of its columns when several outputs are selected: the
    /// key, or `output<k>`.
    pub fn column_prefix(&self) -> String {
        match self {
            Selector::Name(n) => n.clone(),
            Selector::Index(i) => format!("output{i}"),
        }
    }
}

/// How a `[rows, L, D]` output (a last hidden state) becomes one vector per
/// row.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Pooling {
    /// The first position's vector (BERT's `[CLS]`).
    Cls,
    /// The mean over positions where the attention mask is 1.
    Mean,
}

manifest_names!(Pooling {
    "cls" => Cls,
    "mean" => Mean,
});
