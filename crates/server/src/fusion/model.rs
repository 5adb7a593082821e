//! SandboxFusion's request and response models, field for field as its server declares them
//! (`sandbox/server/sandbox_api.py` and `sandbox/runners/types.py` of bytedance/SandboxFusion),
//! and the checks of what a caller sends. Like SandboxFusion's pydantic models, a request's
//! unknown fields are ignored (clients send extra ones), but every number is bounded here.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// SandboxFusion's `Language` literal: every name its API accepts. Which of them an image can
/// run is found out by [`super::lang`].
pub const LANGUAGES: &[&str] = &[
    "python",
    "cpp",
    "nodejs",
    "go",
    "go_test",
    "java",
    "php",
    "csharp",
    "bash",
    "typescript",
    "sql",
    "rust",
    "cuda",
    "lua",
    "R",
    "perl",
    "D_ut",
    "ruby",
    "scala",
    "julia",
    "pytest",
    "junit",
    "kotlin_script",
    "jest",
    "verilog",
    "python_gpu",
    "lean",
    "swift",
    "racket",
];

/// Longest compile or run timeout a call may ask for, in seconds.
pub const MAX_TIMEOUT_S: f64 = 3600.0;
/// Most memory a call may ask for (`memory_limit_MB`), in MiB.
pub const MAX_MEMORY_MB: i64 = 65_536;
/// Most files a call may send or fetch.
pub const MAX_FILES: usize = 1024;

/// `POST run_code`.
#[derive(Debug, Clone, Deserialize)]
pub struct RunCodeRequest {
    #[serde(default = "ten")]
    pub compile_timeout: f64,
    #[serde(default = "ten")]
    pub run_timeout: f64,
    #[serde(default = "minus_one", rename = "memory_limit_MB")]
    pub memory_limit_mb: i64,
    pub code: String,
    #[serde(default)]
    pub stdin: Option<String>,
    /// Required by SandboxFusion; `python` when absent here, as verl's tutorial tool sends only
    /// `code`.
    #[serde(default = "python")]
    pub language: String,
    /// Path (relative to the working directory) to base64 content; a `null` content is skipped.
    #[serde(default)]
    pub files: BTreeMap<String, Option<String>>,
    #[serde(default)]
    pub fetch_files: Vec<String>,
}

/// `POST run_jupyter`.
#[derive(Debug, Clone, Deserialize)]
pub struct RunJupyterRequest {
    pub cells: Vec<String>,
    #[serde(default)]
    pub cell_timeout: f64,
    #[serde(default = "forty_five")]
    pub total_timeout: f64,
    #[serde(default = "minus_one", rename = "memory_limit_MB")]
    pub memory_limit_mb: i64,
    #[serde(default = "python3")]
    pub kernel: String,
    #[serde(default)]
    pub files: BTreeMap<String, String>,
    #[serde(default)]
    pub fetch_files: Vec<String>,
}

fn ten() -> f64 {
    10.0
}
fn forty_five() -> f64 {
    45.0
}
fn minus_one() -> i64 {
    -1
}
fn python() -> String {
    "python".into()
}
fn python3() -> String {
    "python3".into()
}

/// `RunStatus`: the call's outcome.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum RunStatus {
    /// Every command finished with 0.
    Success,
    /// A command timed out or exited non-zero: the program's own failure.
    Failed,
    /// The sandbox could not run it: an infrastructure failure, never the program's.
    SandboxError,
}

/// `CommandRunStatus`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum CommandRunStatus {
    Finished,
    Error,
    TimeLimitExceeded,
}

/// `CommandRunResult`: one command (a compile or the run).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CommandRunResult {
    pub status: CommandRunStatus,
    /// Seconds.
    pub execution_time: Option<f64>,
    /// `-N` when a signal N ended it, as Python's `returncode` says; none after a timeout.
    pub return_code: Option<i32>,
    pub stdout: Option<String>,
    pub stderr: Option<String>,
}

impl CommandRunResult {
    /// A command the sandbox could not run, with why.
    pub fn error(message: String) -> Self {
        CommandRunResult {
            status: CommandRunStatus::Error,
            execution_time: None,
            return_code: None,
            stdout: None,
            stderr: Some(message),
        }
    }

    /// Whether it finished with exit code 0.
    pub fn succeeded(&self) -> bool {
        self.status == CommandRunStatus::Finished && self.return_code == Some(0)
    }
}

/// `RunCodeResponse`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RunCodeResponse {
    pub status: RunStatus,
    pub message: String,
    pub compile_result: Option<CommandRunResult>,
    pub run_result: Option<CommandRunResult>,
    /// The sandbox that ran it (SandboxFusion names its pod here).
    pub executor_pod_name: Option<String>,
    pub files: BTreeMap<String, String>,
}

impl RunCodeResponse {
    /// A call the service could not run: status `SandboxError`, with why.
    pub fn sandbox_error(message: String) -> Self {
        RunCodeResponse {
            status: RunStatus::SandboxError,
            message,
            compile_result: None,
            run_result: None,
            executor_pod_name: None,
            files: BTreeMap::new(),
        }
    }

    /// The outcome of the commands, as SandboxFusion's `parse_run_status` decides it: an
    /// `Error` is the sandbox's (with its stderr as the message), a timeout or a non-zero exit
    /// the program's.
    pub fn settle(&mut self) {
        let results = [&self.compile_result, &self.run_result];
        let results = results.iter().filter_map(|r| r.as_ref());
        for r in results.clone() {
            if r.status == CommandRunStatus::Error {
                self.status = RunStatus::SandboxError;
                self.message = r.stderr.clone().unwrap_or_default();
                return;
            }
        }
        let failed = results
            .clone()
            .any(|r| r.status == CommandRunStatus::TimeLimitExceeded || r.return_code.is_some_and(|c| c != 0));
        self.status = if failed { RunStatus::Failed } else { RunStatus::Success };
    }
}

/// `CellRunResult` (with the kernel's `status` of the cell, as SandboxFusion's driver adds it).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CellRunResult {
    pub stdout: String,
    pub stderr: String,
    pub display: Vec<serde_json::Map<String, serde_json::Value>>,
    pub error: Vec<serde_json::Map<String, serde_json::Value>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub status: Option<String>,
}

/// `RunJupyterResponse`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RunJupyterResponse {
    pub status: RunStatus,
    pub message: String,
    pub driver: Option<CommandRunResult>,
    pub cells: Vec<CellRunResult>,
    pub executor_pod_name: Option<String>,
    pub files: BTreeMap<String, String>,
}

impl RunJupyterResponse {
    pub fn sandbox_error(message: String) -> Self {
        RunJupyterResponse {
            status: RunStatus::SandboxError,
            message,
            driver: None,
            cells: Vec::new(),
            executor_pod_name: None,
            files: BTreeMap::new(),
        }
    }
}

/// One problem with a request, in the shape FastAPI (SandboxFusion's server) answers 422 with:
/// `{"detail": [{"type", "loc", "msg", "input"}]}`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Invalid {
    #[serde(rename = "type")]
    pub kind: &'static str,
    pub loc: Vec<String>,
    pub msg: String,
    pub input: serde_json::Value,
}

impl Invalid {
    fn new(kind: &'static str, field: &str, msg: String, input: serde_json::Value) -> Self {
        Invalid { kind, loc: vec!["body".into(), field.into()], msg, input }
    }
}

/// A timeout in seconds, checked: finite, not negative, at most [`MAX_TIMEOUT_S`].
fn check_timeout(field: &str, s: f64, out: &mut Vec<Invalid>) {
    if !s.is_finite() || !(0.0..=MAX_TIMEOUT_S).contains(&s) {
        out.push(Invalid::new(
            "less_than_equal",
            field,
            format!("Input should be a number of seconds from 0 to {MAX_TIMEOUT_S}"),
            serde_json::json!(if s.is_finite() { serde_json::json!(s) } else { serde_json::json!(s.to_string()) }),
        ));
    }
}

fn check_memory(mb: i64, out: &mut Vec<Invalid>) {
    if mb != -1 && !(1..=MAX_MEMORY_MB).contains(&mb) {
        out.push(Invalid::new(
            "less_than_equal",
            "memory_limit_MB",
            format!("Input should be -1 (the server's default) or from 1 to {MAX_MEMORY_MB}"),
            serde_json::json!(mb),
        ));
    }
}

fn check_paths<'a>(field: &str, paths: impl Iterator<Item = &'a String>, out: &mut Vec<Invalid>) {
    let mut n = 0;
    for p in paths {
        n += 1;
        if p.is_empty() || p.contains('\0') {
            out.push(Invalid::new(
                "value_error",
                field,
                "a file path is empty or holds NUL".into(),
                serde_json::json!(p),
            ));
        }
    }
    if n > MAX_FILES {
        out.push(Invalid::new("too_long", field, format!("at most {MAX_FILES} files"), serde_json::json!(n)));
    }
}

impl RunCodeRequest {
    /// Every problem of the request, as FastAPI would list them.
    pub fn check(&self) -> Vec<Invalid> {
        let mut out = Vec::new();
        if !LANGUAGES.contains(&self.language.as_str()) {
            out.push(Invalid::new(
                "literal_error",
                "language",
                format!(
                    "Input should be one of {}",
                    LANGUAGES.iter().map(|l| format!("'{l}'")).collect::<Vec<_>>().join(", ")
                ),
                serde_json::json!(self.language),
            ));
        }
        check_timeout("compile_timeout", self.compile_timeout, &mut out);
        check_timeout("run_timeout", self.run_timeout, &mut out);
        check_memory(self.memory_limit_mb, &mut out);
        check_paths("files", self.files.keys(), &mut out);
        check_paths("fetch_files", self.fetch_files.iter(), &mut out);
        out
    }
}

impl RunJupyterRequest {
    pub fn check(&self) -> Vec<Invalid> {
        let mut out = Vec::new();
        if self.kernel != "python3" {
            out.push(Invalid::new(
                "literal_error",
                "kernel",
                "Input should be 'python3'".into(),
                serde_json::json!(self.kernel),
            ));
        }
        check_timeout("cell_timeout", self.cell_timeout, &mut out);
        check_timeout("total_timeout", self.total_timeout, &mut out);
        check_memory(self.memory_limit_mb, &mut out);
        check_paths("files", self.files.keys(), &mut out);
        check_paths("fetch_files", self.fetch_files.iter(), &mut out);
        if self.cells.len() > MAX_FILES {
            out.push(Invalid::new(
                "too_long",
                "cells",
                format!("at most {MAX_FILES} cells"),
                serde_json::json!(self.cells.len()),
            ));
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn result(status: CommandRunStatus, code: Option<i32>) -> Option<CommandRunResult> {
        Some(CommandRunResult {
            status,
            execution_time: Some(0.1),
            return_code: code,
            stdout: None,
            stderr: Some("e".into()),
        })
    }

    fn settled(compile: Option<CommandRunResult>, run: Option<CommandRunResult>) -> RunStatus {
        let mut r = RunCodeResponse::sandbox_error(String::new());
        r.compile_result = compile;
        r.run_result = run;
        r.settle();
        r.status
    }

    #[test]
    fn the_outcome_follows_sandboxfusions_parse_run_status() {
        use CommandRunStatus::*;
        assert_eq!(settled(None, result(Finished, Some(0))), RunStatus::Success);
        assert_eq!(settled(result(Finished, Some(0)), result(Finished, Some(0))), RunStatus::Success);
        assert_eq!(settled(None, result(Finished, Some(1))), RunStatus::Failed);
        assert_eq!(settled(None, result(Finished, Some(-9))), RunStatus::Failed);
        assert_eq!(settled(result(Finished, Some(1)), None), RunStatus::Failed);
        assert_eq!(settled(None, result(TimeLimitExceeded, None)), RunStatus::Failed);
        assert_eq!(settled(result(TimeLimitExceeded, None), None), RunStatus::Failed);
        assert_eq!(settled(None, result(Error, None)), RunStatus::SandboxError);
        assert_eq!(settled(result(Error, None), None), RunStatus::SandboxError);
    }

    #[test]
    fn a_request_with_only_code_is_python_with_sandboxfusions_defaults() {
        let r: RunCodeRequest =
            serde_json::from_str(r#"{"code": "print(1)", "extra": true}"#).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(
            (r.language.as_str(), r.compile_timeout, r.run_timeout, r.memory_limit_mb),
            ("python", 10.0, 10.0, -1)
        );
        assert!(r.stdin.is_none() && r.files.is_empty() && r.fetch_files.is_empty());
        assert!(r.check().is_empty());
        let j: RunJupyterRequest = serde_json::from_str(r#"{"cells": ["1"]}"#).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!((j.cell_timeout, j.total_timeout, j.kernel.as_str()), (0.0, 45.0, "python3"));
    }

    #[test]
    fn numbers_past_their_bounds_and_unknown_languages_are_listed_by_field() {
        let r: RunCodeRequest = serde_json::from_value(serde_json::json!({
            "code": "", "language": "cobol", "run_timeout": 1e9, "compile_timeout": -1, "memory_limit_MB": 0,
        }))
        .unwrap_or_else(|e| panic!("{e}"));
        let fields: Vec<String> = r.check().into_iter().map(|i| i.loc[1].clone()).collect();
        assert_eq!(fields, ["language", "compile_timeout", "run_timeout", "memory_limit_MB"]);
    }

    #[test]
    fn responses_serialize_with_sandboxfusions_names() {
        let mut r = RunCodeResponse::sandbox_error("m".into());
        r.run_result = result(CommandRunStatus::TimeLimitExceeded, None);
        let v = serde_json::to_value(&r).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(v["status"], "SandboxError");
        assert_eq!(v["run_result"]["status"], "TimeLimitExceeded");
        assert!(v["run_result"]["return_code"].is_null());
        assert!(v["compile_result"].is_null());
        assert_eq!(v["files"], serde_json::json!({}));
    }
}
