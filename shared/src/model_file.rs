//! What a model file is, read from its bytes: a TorchScript archive, or one
//! of the files PyTorch users most often mistake for one.
//!
//! `torch.jit.save` (TorchScript), `torch.save` (a `state_dict` or a pickled
//! module) and `torch.export.save` (a `.pt2` package) all write zip archives,
//! so the zip signature alone says nothing. The archive's entries do:
//!
//! | kind | entries under the archive's one top folder |
//! | --- | --- |
//! | TorchScript | `code/…` and `constants.pkl` (plus `data.pkl`, `data/…`) |
//! | `torch.save(model.state_dict())` | `data.pkl` (an `OrderedDict` of tensors), `data/…`, no `code/` |
//! | `torch.save(model)` | `data.pkl` holding the module's `_modules`, `_parameters`, …, no `code/` |
//! | `torch.export.save` | `archive_format` (`pt2`), `models/…`, `data/weights/…` |
//! | `torch._inductor.aoti_compile_and_package` (AOTInductor) | `archive_format` (`pt2`), `data/aotinductor/<model>/…` (the compiled `.so`) |
//!
//! Only the zip central directory (and the head of `data.pkl` when needed) is
//! read, so inspecting a model of many gigabytes costs a few reads.
//! ZIP64 archives (models over 4 GiB) are understood.

use std::io::{self, Read, Seek, SeekFrom};
use std::path::Path;

/// The one-line fix for anything that is not TorchScript.
pub const EXPORT_FIX: &str = "export it with torch.jit.script(model) (or torch.jit.trace(model, example)) and save that with torch.jit.save(...)";

/// What a model file holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ModelKind {
    /// A TorchScript archive (`torch.jit.save`): what batchfleet runs.
    TorchScript,
    /// Weights only (`torch.save(model.state_dict())`).
    StateDict,
    /// A whole module pickled with `torch.save(model)`: needs its Python class to load.
    PickledModule,
    /// A `torch.export` package (`torch.export.save`, `.pt2`): a program, not compiled.
    ExportedProgram,
    /// An AOTInductor package (`torch._inductor.aoti_compile_and_package`,
    /// `.pt2`): the model compiled ahead of time for one device.
    AotiPackage,
    /// A pickle written by `torch.save` with the legacy (non-zip) format.
    LegacyPickle,
    /// A zip archive, but none of the above.
    OtherZip,
    /// Not a zip archive at all.
    NotAnArchive,
}

impl ModelKind {
    /// Whether it is a TorchScript archive.
    pub fn is_torchscript(&self) -> bool {
        matches!(self, ModelKind::TorchScript)
    }

    /// Whether batchfleet can run it: TorchScript, or an AOTInductor package.
    pub fn is_runnable(&self) -> bool {
        matches!(self, ModelKind::TorchScript | ModelKind::AotiPackage)
    }

    /// What the file is, in words, for an error message.
    pub fn describe(&self) -> &'static str {
        match self {
            ModelKind::TorchScript => "a TorchScript archive",
            ModelKind::StateDict => {
                "a state_dict (weights only, written by torch.save(model.state_dict())), not TorchScript"
            }
            ModelKind::PickledModule => {
                "a pickled Python module (written by torch.save(model)), not TorchScript"
            }
            ModelKind::ExportedProgram => {
                "a torch.export program (.pt2, written by torch.export.save), not compiled: batchfleet runs it once compiled into an AOTInductor package with torch._inductor.aoti_compile_and_package(program, package_path=\"model.pt2\")"
            }
            ModelKind::AotiPackage => "an AOTInductor package (.pt2)",
            ModelKind::LegacyPickle => {
                "a legacy torch.save pickle (not a zip archive), not TorchScript"
            }
            ModelKind::OtherZip => {
                "a zip archive without TorchScript code (no code/ and constants.pkl entries)"
            }
            ModelKind::NotAnArchive => {
                "not a TorchScript file (expected the zip archive torch.jit.save writes)"
            }
        }
    }
}

/// Inspects the model file at `path`.
pub fn inspect_file(path: &Path) -> io::Result<ModelKind> {
    let mut f = std::fs::File::open(path)?;
    inspect(&mut f)
}

/// Inspects a model already in memory (the bytes a worker hashed and will load).
pub fn inspect_bytes(bytes: &[u8]) -> ModelKind {
    inspect(&mut io::Cursor::new(bytes)).unwrap_or(ModelKind::NotAnArchive)
}

/// Inspects a model from any seekable reader.
pub fn inspect<R: Read + Seek>(r: &mut R) -> io::Result<ModelKind> {
    let len = r.seek(SeekFrom::End(0))?;
    let mut magic = [0u8; 4];
    r.seek(SeekFrom::Start(0))?;
    if len < 4 {
        return Ok(ModelKind::NotAnArchive);
    }
    r.read_exact(&mut magic)?;
    if magic != *b"PK\x03\x04" {
        // Pickle protocol 2+ starts with PROTO (0x80) and the protocol number.
        return Ok(if magic[0] == 0x80 && (2..=5).contains(&magic[1]) {
            ModelKind::LegacyPickle
        } else {
            ModelKind::NotAnArchive
        });
    }
    let Some(entries) = central_directory(r, len)? else {
        return Ok(ModelKind::NotAnArchive);
    };
    let names: Vec<&str> = entries.iter().map(|e| in_archive(&e.name)).collect();
    let has = |n: &str| names.contains(&n);
    if has("archive_format") && names.iter().any(|n| n.starts_with("data/aotinductor/")) {
        return Ok(ModelKind::AotiPackage);
    }
    if has("archive_format") || names.iter().any(|n| n.starts_with("models/")) {
        return Ok(ModelKind::ExportedProgram);
    }
    if names.iter().any(|n| n.starts_with("code/")) && has("constants.pkl") {
        return Ok(ModelKind::TorchScript);
    }
    let Some(pkl) = entries.iter().find(|e| in_archive(&e.name) == "data.pkl") else {
        return Ok(ModelKind::OtherZip);
    };
    // A pickled module stores its attributes (`_modules`, `_parameters`, …)
    // near the start of data.pkl; a state_dict is an OrderedDict of tensors.
    let head = entry_head(r, pkl, 1 << 20)?;
    let contains = |needle: &[u8]| head.windows(needle.len()).any(|w| w == needle);
    Ok(if contains(b"_modules") || contains(b"_parameters") {
        ModelKind::PickledModule
    } else {
        ModelKind::StateDict
    })
}

/// An entry's name below the archive's top folder: every writer in torch
/// puts the entries under one (the file's stem).
fn in_archive(name: &str) -> &str {
    name.split_once('/').map_or(name, |(_, rest)| rest)
}

/// What a model archive says about the torch that wrote it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Provenance {
    /// A TorchScript archive's file format version (its `version` entry):
    /// the oldest format that holds what it uses, not the torch release.
    pub format_version: Option<u64>,
    /// The torch release a `torch.export` or AOTInductor package records
    /// (`torch_version` in its `models/*.json`), e.g. `2.13.0+cu130`.
    pub torch_version: Option<String>,
}

/// The newest TorchScript file format libtorch 2.x reads
/// (`caffe2::serialize::kMaxSupportedFileFormatVersion`).
pub const MAX_FORMAT_VERSION: u64 = 10;

/// Reads [`Provenance`] from the archive at `path` (empty for a file that
/// is not an archive, or says nothing).
pub fn provenance_file(path: &Path) -> io::Result<Provenance> {
    let mut f = std::fs::File::open(path)?;
    provenance(&mut f)
}

/// Reads [`Provenance`] from any seekable reader.
pub fn provenance<R: Read + Seek>(r: &mut R) -> io::Result<Provenance> {
    let len = r.seek(SeekFrom::End(0))?;
    let mut out = Provenance::default();
    let Some(entries) = central_directory(r, len)? else {
        return Ok(out);
    };
    if let Some(v) = entries.iter().find(|e| in_archive(&e.name) == "version") {
        let text = entry_head(r, v, 64)?;
        out.format_version = std::str::from_utf8(&text)
            .ok()
            .and_then(|t| t.trim().parse().ok());
    }
    for e in entries.iter().filter(|e| {
        let name = in_archive(&e.name);
        name.starts_with("models/") && name.ends_with(".json")
    }) {
        // `torch_version` comes late in the program's JSON, after the graph.
        let text = entry_head(r, e, 256 << 20)?;
        if let Some(v) = json_string_field(&text, b"\"torch_version\"") {
            out.torch_version = Some(v);
            break;
        }
    }
    Ok(out)
}

/// The string value of `"key": "…"` in JSON text, found without parsing the rest.
fn json_string_field(text: &[u8], key: &[u8]) -> Option<String> {
    let at = text.windows(key.len()).position(|w| w == key)? + key.len();
    let rest = &text[at..];
    let colon = rest.iter().position(|&b| !b.is_ascii_whitespace())?;
    let rest = rest[colon..].strip_prefix(b":")?;
    let start = rest.iter().position(|&b| !b.is_ascii_whitespace())?;
    let rest = rest[start..].strip_prefix(b"\"")?;
    let end = rest.iter().position(|&b| b == b'"')?;
    let value = std::str::from_utf8(&rest[..end]).ok()?;
    (!value.is_empty() && value.len() <= 64 && value.chars().all(|c| c.is_ascii_graphic()))
        .then(|| value.to_owned())
}

/// The release part of a torch version (`2.13.0+cu130` → `2.13.0`).
fn release(version: &str) -> &str {
    version
        .split(['+', 'a', 'b', 'r', 'd'])
        .next()
        .unwrap_or(version)
}

/// A warning for a model written by another torch than the libtorch
/// batchfleet runs (`linked`, e.g. `2.13.0`), or `None` where the archive
/// says nothing against it. A package (`.pt2`) loads only in the torch
/// release that wrote it; a TorchScript archive loads in the same or a
/// newer libtorch, up to [`MAX_FORMAT_VERSION`].
pub fn version_warning(p: &Provenance, linked: &str) -> Option<String> {
    let linked = release(linked);
    if let Some(wrote) = &p.torch_version {
        if release(wrote) != linked {
            return Some(format!(
                "the model package says it was written by torch {wrote}, but batchfleet runs libtorch {linked}: a .pt2 package loads only in the torch release that wrote it; export and compile it again with torch=={linked}"
            ));
        }
    }
    match p.format_version {
        Some(v) if v > MAX_FORMAT_VERSION => Some(format!(
            "the model is a TorchScript archive of format version {v}, newer than libtorch {linked} reads (at most {MAX_FORMAT_VERSION}): it was written by a newer torch; save it again with torch=={linked} (or older)"
        )),
        _ => None,
    }
}

/// One parameter of a TorchScript module's `forward` (after `self`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Param {
    /// Its name.
    pub name: String,
    /// Its type as TorchScript wrote it (`Tensor`, `Optional[Tensor]`, …).
    pub ty: String,
    /// Whether it has a default value (callers may leave it out).
    pub has_default: bool,
}

/// The parameters of the root module's `forward` in the TorchScript archive
/// at `path`, read from the code the archive carries: `data.pkl` names the
/// root module's class, whose file under `code/` holds `def forward(self:
/// <class>, …)`. `Ok(None)` when the archive does not say (not TorchScript,
/// compressed entries, or code this reader does not follow).
pub fn forward_params(path: &Path) -> io::Result<Option<Vec<Param>>> {
    forward_params_from(&mut std::fs::File::open(path)?)
}

/// [`forward_params`] from any seekable reader.
pub fn forward_params_from<R: Read + Seek>(f: &mut R) -> io::Result<Option<Vec<Param>>> {
    let len = f.seek(SeekFrom::End(0))?;
    let Some(entries) = central_directory(f, len)? else {
        return Ok(None);
    };
    let Some(pkl) = entries
        .iter()
        .find(|e| e.name.split_once('/').is_some_and(|(_, r)| r == "data.pkl"))
    else {
        return Ok(None);
    };
    let top = pkl.name.split_once('/').map_or("", |(t, _)| t).to_owned();
    // PROTO 2, then GLOBAL `c<module>\n<class>\n`: the root object's class.
    let head = entry_head(f, pkl, 4096)?;
    let Some(global) = head.get(2..).filter(|h| h.first() == Some(&b'c')) else {
        return Ok(None);
    };
    let text = String::from_utf8_lossy(&global[1..]);
    let mut lines = text.split('\n');
    let (Some(module), Some(class)) = (lines.next(), lines.next()) else {
        return Ok(None);
    };
    // `__torch__` lives in code/__torch__.py, `__torch__.a.b` in code/__torch__/a/b.py.
    let code = format!("{top}/code/{}.py", module.replace('.', "/"));
    let Some(entry) = entries.iter().find(|e| e.name == code) else {
        return Ok(None);
    };
    let source = entry_head(f, entry, 64 << 20)?;
    Ok(parse_forward(
        &String::from_utf8_lossy(&source),
        &format!("{module}.{class}"),
    ))
}

/// The parameters after `self` of `def forward(self: <class>, …)` in
/// TorchScript's generated code.
fn parse_forward(source: &str, class: &str) -> Option<Vec<Param>> {
    let start = source.find(&format!("def forward(self: {class}"))?;
    let rest = &source[start + "def forward(".len()..];
    // The parameter list ends at the `)` closing `forward(`.
    let (mut depth, mut end) = (0i32, None);
    for (i, c) in rest.char_indices() {
        match c {
            '(' | '[' => depth += 1,
            ']' => depth -= 1,
            ')' if depth == 0 => {
                end = Some(i);
                break;
            }
            ')' => depth -= 1,
            _ => {}
        }
    }
    let list = &rest[..end?];
    let mut params = Vec::new();
    let (mut depth, mut from) = (0i32, 0usize);
    let mut pieces = Vec::new();
    for (i, c) in list.char_indices() {
        match c {
            '(' | '[' => depth += 1,
            ')' | ']' => depth -= 1,
            ',' if depth == 0 => {
                pieces.push(&list[from..i]);
                from = i + 1;
            }
            _ => {}
        }
    }
    pieces.push(&list[from..]);
    for piece in pieces.into_iter().skip(1) {
        let piece = piece.trim();
        if piece.is_empty() {
            continue;
        }
        let (decl, default) = match piece.split_once('=') {
            Some((d, _)) => (d.trim(), true),
            None => (piece, false),
        };
        let (name, ty) = decl.split_once(':').unwrap_or((decl, ""));
        params.push(Param {
            name: name.trim().to_owned(),
            ty: ty.trim().to_owned(),
            has_default: default,
        });
    }
    Some(params)
}

/// One central directory entry.
#[derive(Debug)]
struct Entry {
    name: String,
    method: u16,
    compressed: u64,
    local_offset: u64,
}

fn u16_at(b: &[u8], at: usize) -> u16 {
    u16::from_le_bytes([b[at], b[at + 1]])
}
fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}
fn u64_at(b: &[u8], at: usize) -> u64 {
    let mut x = [0u8; 8];
    x.copy_from_slice(&b[at..at + 8]);
    u64::from_le_bytes(x)
}

/// Most entries read from a central directory (a TorchScript file has tens to thousands).
const MAX_ENTRIES: u64 = 1 << 20;
/// Largest central directory read.
const MAX_DIRECTORY: u64 = 256 << 20;

/// The archive's entries, `None` if its end records are missing or inconsistent.
fn central_directory<R: Read + Seek>(r: &mut R, len: u64) -> io::Result<Option<Vec<Entry>>> {
    // The end-of-central-directory record is in the last 22 + 65535 bytes.
    let tail_len = len.min(22 + 65_535);
    let mut tail = vec![0u8; tail_len as usize];
    r.seek(SeekFrom::Start(len - tail_len))?;
    r.read_exact(&mut tail)?;
    let Some(eocd) = (0..tail.len().saturating_sub(21))
        .rev()
        .find(|&i| u32_at(&tail, i) == 0x0605_4b50)
    else {
        return Ok(None);
    };
    let mut count = u64::from(u16_at(&tail, eocd + 10));
    let mut size = u64::from(u32_at(&tail, eocd + 12));
    let mut offset = u64::from(u32_at(&tail, eocd + 16));
    if count == 0xFFFF || size == 0xFFFF_FFFF || offset == 0xFFFF_FFFF {
        // ZIP64: a locator just before the record points at the ZIP64 end record.
        let Some(loc) = eocd.checked_sub(20) else {
            return Ok(None);
        };
        if u32_at(&tail, loc) != 0x0706_4b50 {
            return Ok(None);
        }
        let end64 = u64_at(&tail, loc + 8);
        if end64.checked_add(56).is_none_or(|end| end > len) {
            return Ok(None);
        }
        let mut rec = [0u8; 56];
        r.seek(SeekFrom::Start(end64))?;
        r.read_exact(&mut rec)?;
        if u32_at(&rec, 0) != 0x0606_4b50 {
            return Ok(None);
        }
        count = u64_at(&rec, 32);
        size = u64_at(&rec, 40);
        offset = u64_at(&rec, 48);
    }
    if count > MAX_ENTRIES || size > MAX_DIRECTORY || offset.saturating_add(size) > len {
        return Ok(None);
    }
    let mut dir = vec![0u8; size as usize];
    r.seek(SeekFrom::Start(offset))?;
    r.read_exact(&mut dir)?;
    let mut entries = Vec::with_capacity(count as usize);
    let mut at = 0usize;
    for _ in 0..count {
        if at + 46 > dir.len() || u32_at(&dir, at) != 0x0201_4b50 {
            return Ok(None);
        }
        let method = u16_at(&dir, at + 10);
        let mut compressed = u64::from(u32_at(&dir, at + 20));
        let uncompressed = u32_at(&dir, at + 24);
        let name_len = usize::from(u16_at(&dir, at + 28));
        let extra_len = usize::from(u16_at(&dir, at + 30));
        let comment_len = usize::from(u16_at(&dir, at + 32));
        let mut local_offset = u64::from(u32_at(&dir, at + 42));
        let name_at = at + 46;
        let end = name_at + name_len + extra_len + comment_len;
        if end > dir.len() {
            return Ok(None);
        }
        let name = String::from_utf8_lossy(&dir[name_at..name_at + name_len]).into_owned();
        // ZIP64 extra field (id 1): the 64-bit values of the fields set to all ones, in order.
        let mut extra = &dir[name_at + name_len..name_at + name_len + extra_len];
        while extra.len() >= 4 {
            let (id, n) = (u16_at(extra, 0), usize::from(u16_at(extra, 2)));
            let body = &extra[4..(4 + n).min(extra.len())];
            if id == 1 {
                let mut k = 0;
                let mut next = || {
                    let v = body.get(k..k + 8).map(|b| u64_at(b, 0));
                    k += 8;
                    v
                };
                if uncompressed == 0xFFFF_FFFF {
                    next();
                }
                if compressed == 0xFFFF_FFFF {
                    compressed = next().unwrap_or(compressed);
                }
                if local_offset == 0xFFFF_FFFF {
                    local_offset = next().unwrap_or(local_offset);
                }
            }
            extra = &extra[(4 + n).min(extra.len())..];
        }
        entries.push(Entry {
            name,
            method,
            compressed,
            local_offset,
        });
        at = end;
    }
    Ok(Some(entries))
}

/// The first `max` bytes of a stored (uncompressed) entry, or of a
/// deflated one (torch stores tensors and pickles, and deflates `code/`),
/// inflated; empty for another method, or a deflated entry that inflates
/// to more than `max`.
fn entry_head<R: Read + Seek>(r: &mut R, e: &Entry, max: u64) -> io::Result<Vec<u8>> {
    if e.method != 0 && e.method != 8 {
        return Ok(Vec::new());
    }
    let mut local = [0u8; 30];
    r.seek(SeekFrom::Start(e.local_offset))?;
    r.read_exact(&mut local)?;
    if u32_at(&local, 0) != 0x0403_4b50 {
        return Ok(Vec::new());
    }
    let skip = u64::from(u16_at(&local, 26)) + u64::from(u16_at(&local, 28));
    r.seek(SeekFrom::Current(skip as i64))?;
    let mut head = Vec::new();
    if e.method == 8 {
        r.take(e.compressed.min(max)).read_to_end(&mut head)?;
        return Ok(
            miniz_oxide::inflate::decompress_to_vec_with_limit(&head, max as usize)
                .unwrap_or_default(),
        );
    }
    r.take(e.compressed.min(max)).read_to_end(&mut head)?;
    Ok(head)
}

/// A zip archive of stored (uncompressed) entries, as torch writes them:
/// for tests that need a model file of a given kind without PyTorch.
#[doc(hidden)]
pub fn stored_zip(entries: &[(&str, &[u8])]) -> Vec<u8> {
    let mut out = Vec::new();
    let mut central = Vec::new();
    for (name, data) in entries {
        let offset = out.len() as u32;
        let crc = 0u32; // not checked by the inspector
        let mut local = Vec::new();
        local.extend_from_slice(&0x0403_4b50u32.to_le_bytes());
        local.extend_from_slice(&[20, 0, 0, 0, 0, 0, 0, 0, 0, 0]);
        local.extend_from_slice(&crc.to_le_bytes());
        local.extend_from_slice(&(data.len() as u32).to_le_bytes());
        local.extend_from_slice(&(data.len() as u32).to_le_bytes());
        local.extend_from_slice(&(name.len() as u16).to_le_bytes());
        local.extend_from_slice(&0u16.to_le_bytes());
        out.extend_from_slice(&local);
        out.extend_from_slice(name.as_bytes());
        out.extend_from_slice(data);
        central.extend_from_slice(&0x0201_4b50u32.to_le_bytes());
        central.extend_from_slice(&[20, 0, 20, 0, 0, 0, 0, 0, 0, 0, 0, 0]);
        central.extend_from_slice(&crc.to_le_bytes());
        central.extend_from_slice(&(data.len() as u32).to_le_bytes());
        central.extend_from_slice(&(data.len() as u32).to_le_bytes());
        central.extend_from_slice(&(name.len() as u16).to_le_bytes());
        central.extend_from_slice(&[0; 12]);
        central.extend_from_slice(&offset.to_le_bytes());
        central.extend_from_slice(name.as_bytes());
    }
    let dir_at = out.len() as u32;
    out.extend_from_slice(&central);
    out.extend_from_slice(&0x0605_4b50u32.to_le_bytes());
    out.extend_from_slice(&[0, 0, 0, 0]);
    out.extend_from_slice(&(entries.len() as u16).to_le_bytes());
    out.extend_from_slice(&(entries.len() as u16).to_le_bytes());
    out.extend_from_slice(&(central.len() as u32).to_le_bytes());
    out.extend_from_slice(&dir_at.to_le_bytes());
    out.extend_from_slice(&[0, 0]);
    out
}

/// The smallest archive [`inspect`] takes for TorchScript (not loadable by libtorch).
#[doc(hidden)]
pub fn torchscript_like_zip() -> Vec<u8> {
    stored_zip(&[
        ("m/data.pkl", b"x"),
        ("m/code/__torch__.py", b"def forward"),
        ("m/constants.pkl", b"c"),
        ("m/version", b"3"),
    ])
}

#[cfg(test)]
mod tests {
    #[test]
    fn provenance_says_which_torch_wrote_a_package() {
        let ts = torchscript_like_zip();
        let p = provenance(&mut io::Cursor::new(&ts)).unwrap();
        assert_eq!(p.format_version, Some(3));
        assert_eq!(p.torch_version, None);
        assert_eq!(version_warning(&p, "2.13.0+cu130"), None);
        let newer = stored_zip(&[
            ("m/version", b"11\n"),
            (
                "m/code/__torch__.py",
                b"def forward(self, x):\n  return x\n",
            ),
            ("m/constants.pkl", b""),
        ]);
        let p = provenance(&mut io::Cursor::new(&newer)).unwrap();
        let w = version_warning(&p, "2.13.0").expect("a newer format is named");
        assert!(
            w.contains("format version 11") && w.contains("torch==2.13.0"),
            "{w}"
        );
        let json = br#"{"graph_module": {"graph": {}}, "schema_version": {"major": 8}, "torch_version": "2.12.1+cpu", "guards_code": []}"#;
        let package = stored_zip(&[
            ("m/archive_format", b"pt2"),
            ("m/models/model.json", json),
            ("m/data/aotinductor/model/x.so", b""),
        ]);
        let p = provenance(&mut io::Cursor::new(&package)).unwrap();
        assert_eq!(p.torch_version.as_deref(), Some("2.12.1+cpu"));
        let w = version_warning(&p, "2.13.0+cu130").expect("another release is named");
        assert!(
            w.contains("torch 2.12.1+cpu") && w.contains("libtorch 2.13.0"),
            "{w}"
        );
        // The same release with another build tag is the same torch.
        let same = Provenance {
            torch_version: Some("2.13.0+cpu".into()),
            ..Default::default()
        };
        assert_eq!(version_warning(&same, "2.13.0+cu130"), None);
        // A forged field is not echoed.
        let odd = br#"{"torch_version": "2.1\u0000 evil"}"#;
        assert_eq!(json_string_field(odd, br#""torch_version""#), None);
    }

    use super::*;

    fn zip(entries: &[(&str, &[u8])]) -> Vec<u8> {
        stored_zip(entries)
    }

    #[test]
    fn forward_parameters_are_read_from_the_archive_code() {
        let code = "class Net(Module):\n  __parameters__ = []\n  def forward(self: __torch__.Net,\n    input_ids: Tensor,\n    mask: Optional[Tensor]=None,\n    pair: Tuple[Tensor, int]) -> Dict[str, Tensor]:\n    return {}\n";
        let bytes = zip(&[
            ("net/data.pkl", b"\x80\x02c__torch__\nNet\nq\x00)"),
            ("net/code/__torch__.py", code.as_bytes()),
            ("net/constants.pkl", b"c"),
        ]);
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("net.pt");
        std::fs::write(&path, bytes).unwrap();
        let params = forward_params(&path).unwrap().expect("found");
        let named: Vec<(&str, &str, bool)> = params
            .iter()
            .map(|p| (p.name.as_str(), p.ty.as_str(), p.has_default))
            .collect();
        assert_eq!(
            named,
            [
                ("input_ids", "Tensor", false),
                ("mask", "Optional[Tensor]", true),
                ("pair", "Tuple[Tensor, int]", false)
            ]
        );
        // A class in a module of its own lives in code/__torch__/<module>.py.
        let bytes = zip(&[
            ("m/data.pkl", b"\x80\x02c__torch__.models\nNet\nq\x00)"),
            (
                "m/code/__torch__/models.py",
                code.replace("__torch__.Net", "__torch__.models.Net")
                    .as_bytes(),
            ),
        ]);
        std::fs::write(&path, bytes).unwrap();
        assert_eq!(forward_params(&path).unwrap().expect("found").len(), 3);
        std::fs::write(&path, zip(&[("m/data.pkl", b"\x80\x02}")])).unwrap();
        assert_eq!(forward_params(&path).unwrap(), None);
    }

    #[test]
    fn each_kind_is_named_from_its_entries() {
        let ts = zip(&[
            ("m/data.pkl", b"x"),
            ("m/code/__torch__.py", b"def forward"),
            ("m/constants.pkl", b"c"),
            ("m/version", b"3"),
        ]);
        assert_eq!(inspect_bytes(&ts), ModelKind::TorchScript);
        let sd = zip(&[
            ("sd/data.pkl", b"\x80\x02ccollections\nOrderedDict\nq\x00"),
            ("sd/data/0", b"...."),
        ]);
        assert_eq!(inspect_bytes(&sd), ModelKind::StateDict);
        let module = zip(&[
            (
                "mod/data.pkl",
                b"\x80\x02c__main__\nM\nq\x00X\x08\x00\x00\x00_modules",
            ),
            ("mod/data/0", b"...."),
        ]);
        assert_eq!(inspect_bytes(&module), ModelKind::PickledModule);
        let pt2 = zip(&[
            ("ep/models/model.json", b"{}"),
            ("ep/archive_format", b"pt2"),
        ]);
        assert_eq!(inspect_bytes(&pt2), ModelKind::ExportedProgram);
        let aoti = zip(&[
            ("m/archive_format", b"pt2"),
            ("m/data/aotinductor/model/x.wrapper.so", b"\x7fELF"),
        ]);
        assert_eq!(inspect_bytes(&aoti), ModelKind::AotiPackage);
        assert!(ModelKind::AotiPackage.is_runnable() && !ModelKind::AotiPackage.is_torchscript());
        assert_eq!(
            inspect_bytes(&zip(&[("a/readme.txt", b"hi")])),
            ModelKind::OtherZip
        );
        assert_eq!(inspect_bytes(b"not a zip"), ModelKind::NotAnArchive);
        assert_eq!(inspect_bytes(b"\x80\x02}q\x00"), ModelKind::LegacyPickle);
        assert_eq!(inspect_bytes(b""), ModelKind::NotAnArchive);
    }

    #[test]
    fn truncated_or_forged_archives_are_not_torchscript_and_do_not_panic() {
        let ts = zip(&[
            ("m/code/__torch__.py", b"def forward"),
            ("m/constants.pkl", b"c"),
        ]);
        for cut in [4, 10, ts.len() / 2, ts.len() - 3] {
            let kind = inspect_bytes(&ts[..cut]);
            assert_ne!(kind, ModelKind::TorchScript, "cut at {cut}");
        }
        // A directory claiming more entries and bytes than the file has.
        let mut forged = ts.clone();
        let n = forged.len();
        forged[n - 12..n - 8].copy_from_slice(&u32::MAX.to_le_bytes());
        assert_ne!(inspect_bytes(&forged), ModelKind::TorchScript);
        assert!(ModelKind::StateDict.describe().contains("state_dict"));
    }

    /// Found by `make fuzz`: a ZIP64 locator whose end-record offset is
    /// near `u64::MAX` overflowed the bounds check.
    #[test]
    fn a_zip64_locator_pointing_past_the_end_of_u64_is_refused() {
        let forged: &[u8] = &[
            3, 0, 0, 0, 0, 0, 80, 75, 6, 7, 0, 10, 0, 0, 255, 255, 255, 255, 255, 255, 255, 255, 0,
            111, 101, 47, 80, 75, 5, 6, 0, 126, 0, 0, 8, 0, 8, 0, 48, 2, 0, 0, 255, 255, 255, 255,
            0, 0,
        ];
        let p = provenance(&mut io::Cursor::new(forged)).unwrap();
        assert_eq!(p, Provenance::default());
        assert_ne!(inspect_bytes(forged), ModelKind::TorchScript);
    }
}
