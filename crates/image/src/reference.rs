//! Image references: [`ImageSource::parse`] reads what a user writes (`python:3.12`,
//! `docker://…`, `docker-daemon:…`, `oci:DIR[:TAG]`, `oci-archive:FILE[:TAG]`,
//! `docker-archive:FILE[:REF]`) with Docker's rules for the plain form ([`DockerRef`]).

use std::fmt;
use std::path::{Path, PathBuf};

use crate::ImageError;

/// The registry a reference names when it names none.
pub const DOCKER_HUB: &str = "docker.io";

/// Where an image comes from, as its reference says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ImageSource {
    /// A plain reference (`python:3.12`): the store's tag index, else the local Docker engine's
    /// image, else the registry; or `docker://REF` (`registry_only`): the store's tag index, else
    /// the registry.
    Registry { name: DockerRef, registry_only: bool },
    /// `docker-daemon:REF`: only the local Docker engine's image.
    Daemon(DockerRef),
    /// `oci:DIR[:TAG]`: an OCI image layout directory.
    OciDir { dir: PathBuf, tag: Option<String> },
    /// `oci-archive:FILE[:TAG]`: a tar of an OCI image layout.
    OciArchive { file: PathBuf, tag: Option<String> },
    /// `docker-archive:FILE[:REF]`: what `docker save` writes; `REF` picks one of several images.
    DockerArchive { file: PathBuf, reference: Option<String> },
}

impl ImageSource {
    /// Parses a reference. Paths are made absolute (against the current directory) but not
    /// resolved; a path holding `:` cannot be named (the first `:` after the transport ends it,
    /// as skopeo reads them).
    pub fn parse(reference: &str) -> Result<ImageSource, ImageError> {
        let fail = |why: &str| ImageError::Parse { reference: reference.to_string(), why: why.to_string() };
        if let Some(rest) = reference.strip_prefix("docker://") {
            return Ok(ImageSource::Registry { name: DockerRef::parse_in(rest, reference)?, registry_only: true });
        }
        if let Some(rest) = reference.strip_prefix("docker-daemon:") {
            return Ok(ImageSource::Daemon(DockerRef::parse_in(rest, reference)?));
        }
        let local = [("oci:", 0), ("oci-archive:", 1), ("docker-archive:", 2)];
        for (prefix, kind) in local {
            let Some(rest) = reference.strip_prefix(prefix) else { continue };
            let (path, tag) = match rest.split_once(':') {
                Some((path, tag)) => (path, Some(tag.to_string())),
                None => (rest, None),
            };
            if path.is_empty() {
                return Err(fail("no path after the transport"));
            }
            if tag.as_deref() == Some("") {
                return Err(fail("an empty tag after the path"));
            }
            let path = absolute(path).map_err(|e| fail(&format!("cannot make the path absolute: {e}")))?;
            return Ok(match kind {
                0 => ImageSource::OciDir { dir: path, tag },
                1 => ImageSource::OciArchive { file: path, tag },
                _ => ImageSource::DockerArchive { file: path, reference: tag },
            });
        }
        Ok(ImageSource::Registry { name: DockerRef::parse_in(reference, reference)?, registry_only: false })
    }

    /// The reference in its full form, as the store's tag index and `list` show it:
    /// `docker.io/library/python:3.12`, `oci:/abs/dir:tag`, …
    pub fn canonical(&self) -> String {
        let with = |transport: &str, path: &Path, tag: &Option<String>| match tag {
            Some(tag) => format!("{transport}:{}:{tag}", path.display()),
            None => format!("{transport}:{}", path.display()),
        };
        match self {
            ImageSource::Registry { name, .. } => name.to_string(),
            ImageSource::Daemon(name) => name.to_string(),
            ImageSource::OciDir { dir, tag } => with("oci", dir, tag),
            ImageSource::OciArchive { file, tag } => with("oci-archive", file, tag),
            ImageSource::DockerArchive { file, reference } => with("docker-archive", file, reference),
        }
    }
}

fn absolute(path: &str) -> std::io::Result<PathBuf> {
    std::path::absolute(path)
}

/// A registry reference, normalised as Docker does: `python:3.12` is
/// `docker.io/library/python:3.12`, a reference with neither tag nor digest is `:latest`,
/// `name@sha256:…` pins a digest, `host:port/name:tag` names a registry.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct DockerRef {
    registry: String,
    repository: String,
    tag: Option<String>,
    digest: Option<String>,
}

impl DockerRef {
    /// Parses a plain reference.
    pub fn parse(reference: &str) -> Result<DockerRef, ImageError> {
        DockerRef::parse_in(reference, reference)
    }

    /// Parses `text`, the part of `whole` after any transport; errors name `whole`.
    fn parse_in(text: &str, whole: &str) -> Result<DockerRef, ImageError> {
        let fail = |why: String| ImageError::Parse { reference: whole.to_string(), why };
        if text.is_empty() {
            return Err(fail("it is empty".into()));
        }
        let (rest, digest) = match text.split_once('@') {
            Some((rest, digest)) => {
                check_digest(digest).map_err(|why| fail(format!("bad digest `{digest}`: {why}")))?;
                (rest, Some(digest.to_string()))
            }
            None => (text, None),
        };
        // A tag follows the last `:` after the last `/` (a `:` before it is a registry's port).
        let last_slash = rest.rfind('/').map_or(0, |i| i + 1);
        let (name, tag) = match rest[last_slash..].rfind(':') {
            Some(i) => {
                let at = last_slash + i;
                let tag = &rest[at + 1..];
                check_tag(tag).map_err(|why| fail(format!("bad tag `{tag}`: {why}")))?;
                (&rest[..at], Some(tag.to_string()))
            }
            None => (rest, None),
        };
        if name.is_empty() {
            return Err(fail("no repository name".into()));
        }
        let (registry, repository) = match name.split_once('/') {
            Some((first, rest))
                if first.contains(['.', ':']) || first == "localhost" || first.chars().any(char::is_uppercase) =>
            {
                (first.to_string(), rest.to_string())
            }
            _ => (DOCKER_HUB.to_string(), name.to_string()),
        };
        check_registry(&registry).map_err(|why| fail(format!("bad registry `{registry}`: {why}")))?;
        let registry = if registry == "index.docker.io" { DOCKER_HUB.to_string() } else { registry };
        let repository = if registry == DOCKER_HUB && !repository.contains('/') {
            format!("library/{repository}")
        } else {
            repository
        };
        check_repository(&repository).map_err(|why| fail(format!("bad repository `{repository}`: {why}")))?;
        if registry.len() + 1 + repository.len() > 255 {
            return Err(fail("the name is longer than 255 characters".into()));
        }
        let tag = if tag.is_none() && digest.is_none() { Some("latest".to_string()) } else { tag };
        Ok(DockerRef { registry, repository, tag, digest })
    }

    /// `docker.io`, `ghcr.io`, `127.0.0.1:5000`.
    pub fn registry(&self) -> &str {
        &self.registry
    }

    /// `library/python`.
    pub fn repository(&self) -> &str {
        &self.repository
    }

    pub fn tag(&self) -> Option<&str> {
        self.tag.as_deref()
    }

    /// The pinned manifest digest, when the reference names one.
    pub fn digest(&self) -> Option<&str> {
        self.digest.as_deref()
    }

    /// The same repository at a digest (no tag).
    pub fn with_digest(&self, digest: &str) -> DockerRef {
        DockerRef { digest: Some(digest.to_string()), tag: None, ..self.clone() }
    }

    /// Whether the registry is on this machine's loopback (`localhost`, 127.0.0.0/8, `[::1]`),
    /// which Docker reaches over plain HTTP.
    pub fn is_loopback(&self) -> bool {
        let host = host_of(&self.registry);
        host == "localhost" || host == "::1" || host.parse::<std::net::Ipv4Addr>().is_ok_and(|ip| ip.is_loopback())
    }

    /// The name Docker's engine knows it by: `python:3.12` for Docker Hub's official images,
    /// `user/repo:tag` for Docker Hub's others, the full name otherwise.
    pub fn familiar(&self) -> String {
        let repository = match self.registry.as_str() {
            DOCKER_HUB => self.repository.strip_prefix("library/").unwrap_or(&self.repository).to_string(),
            registry => format!("{registry}/{}", self.repository),
        };
        match (&self.tag, &self.digest) {
            (_, Some(digest)) => format!("{repository}@{digest}"),
            (Some(tag), None) => format!("{repository}:{tag}"),
            (None, None) => repository,
        }
    }

    /// The reference oci-client pulls: by digest when pinned, else by tag.
    pub(crate) fn to_oci(&self) -> oci_client::Reference {
        match (&self.digest, &self.tag) {
            (Some(digest), _) => {
                oci_client::Reference::with_digest(self.registry.clone(), self.repository.clone(), digest.clone())
            }
            (None, tag) => oci_client::Reference::with_tag(
                self.registry.clone(),
                self.repository.clone(),
                tag.clone().unwrap_or_else(|| "latest".into()),
            ),
        }
    }
}

impl fmt::Display for DockerRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.registry, self.repository)?;
        if let Some(tag) = &self.tag {
            write!(f, ":{tag}")?;
        }
        if let Some(digest) = &self.digest {
            write!(f, "@{digest}")?;
        }
        Ok(())
    }
}

/// The host of `host[:port]` or `[v6]:port`, without brackets.
pub(crate) fn host_of(registry: &str) -> &str {
    if let Some(rest) = registry.strip_prefix('[') {
        return rest.split(']').next().unwrap_or(rest);
    }
    registry.split(':').next().unwrap_or(registry)
}

fn check_tag(tag: &str) -> Result<(), String> {
    let ok_char = |c: char| c.is_ascii_alphanumeric() || c == '_' || c == '.' || c == '-';
    let first_ok = tag.chars().next().is_some_and(|c| c.is_ascii_alphanumeric() || c == '_');
    if tag.is_empty() || tag.len() > 128 || !first_ok || !tag.chars().all(ok_char) {
        return Err("a tag is 1 to 128 of [A-Za-z0-9_.-], not starting with `.` or `-`".into());
    }
    Ok(())
}

/// A digest the store can check: `sha256:` and 64 lowercase hex digits.
pub(crate) fn check_digest(digest: &str) -> Result<(), String> {
    let Some((algorithm, hex)) = digest.split_once(':') else {
        return Err("a digest is `algorithm:hex`".into());
    };
    if algorithm != "sha256" {
        return Err(format!("only sha256 digests are supported, not {algorithm}"));
    }
    if hex.len() != 64 || !hex.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b)) {
        return Err("a sha256 digest has 64 lowercase hex digits".into());
    }
    Ok(())
}

fn check_registry(registry: &str) -> Result<(), String> {
    let (host, port) = if let Some(rest) = registry.strip_prefix('[') {
        let Some((v6, after)) = rest.split_once(']') else { return Err("an unclosed `[`".into()) };
        if v6.parse::<std::net::Ipv6Addr>().is_err() {
            return Err("not an IPv6 address in brackets".into());
        }
        (None, after.strip_prefix(':'))
    } else {
        match registry.split_once(':') {
            Some((host, port)) => (Some(host), Some(port)),
            None => (Some(registry), None),
        }
    };
    if let Some(host) = host {
        let label_ok = |l: &str| {
            !l.is_empty()
                && l.chars().all(|c| c.is_ascii_alphanumeric() || c == '-')
                && !l.starts_with('-')
                && !l.ends_with('-')
        };
        if !host.split('.').all(label_ok) {
            return Err("a host is labels of [A-Za-z0-9-] separated by dots".into());
        }
    }
    if let Some(port) = port
        && port.parse::<u16>().is_err()
    {
        return Err(format!("`{port}` is not a port"));
    }
    Ok(())
}

fn check_repository(repository: &str) -> Result<(), String> {
    for component in repository.split('/') {
        if component.chars().any(|c| c.is_ascii_uppercase()) {
            return Err("a repository name must be lowercase".into());
        }
        if !component_ok(component.as_bytes()) {
            return Err(format!(
                "`{component}` is not a path component: [a-z0-9]+ separated by `.`, `_`, `__` or dashes"
            ));
        }
    }
    Ok(())
}

/// `[a-z0-9]+((\.|_|__|-+)[a-z0-9]+)*`.
fn component_ok(c: &[u8]) -> bool {
    let alnum = |b: u8| b.is_ascii_lowercase() || b.is_ascii_digit();
    let mut i = 0;
    let mut need_alnum = true;
    while i < c.len() {
        if alnum(c[i]) {
            need_alnum = false;
            i += 1;
            continue;
        }
        if need_alnum {
            return false;
        }
        let separator = match c[i] {
            b'.' => 1,
            b'_' if c.get(i + 1) == Some(&b'_') => 2,
            b'_' => 1,
            b'-' => c[i..].iter().take_while(|&&b| b == b'-').count(),
            _ => return false,
        };
        i += separator;
        need_alnum = true;
    }
    !need_alnum
}

#[cfg(test)]
mod tests {
    use super::*;

    fn docker(s: &str) -> DockerRef {
        DockerRef::parse(s).unwrap_or_else(|e| panic!("{e}"))
    }

    #[test]
    fn plain_references_follow_dockers_rules() {
        assert_eq!(docker("python:3.12").to_string(), "docker.io/library/python:3.12");
        assert_eq!(docker("python").to_string(), "docker.io/library/python:latest");
        assert_eq!(docker("user/repo").to_string(), "docker.io/user/repo:latest");
        assert_eq!(docker("index.docker.io/library/python").to_string(), "docker.io/library/python:latest");
        assert_eq!(docker("ghcr.io/org/tool:v1.2").to_string(), "ghcr.io/org/tool:v1.2");
        assert_eq!(docker("localhost/app").registry(), "localhost");
        assert_eq!(docker("127.0.0.1:5000/a/b:t").registry(), "127.0.0.1:5000");
        assert_eq!(docker("127.0.0.1:5000/a/b:t").repository(), "a/b");
        assert_eq!(docker("[::1]:5000/a:t").registry(), "[::1]:5000");
        let digest = format!("sha256:{}", "ab".repeat(32));
        let pinned = docker(&format!("python@{digest}"));
        assert_eq!(pinned.digest(), Some(digest.as_str()));
        assert_eq!(pinned.tag(), None, "a digest alone means no `latest`");
        let both = docker(&format!("python:3.12@{digest}"));
        assert_eq!(both.tag(), Some("3.12"));
        assert_eq!(both.to_string(), format!("docker.io/library/python:3.12@{digest}"));
        assert_eq!(docker("python:3.12").familiar(), "python:3.12");
        assert_eq!(docker("localhost:5000/a:b").familiar(), "localhost:5000/a:b");
        // A first component with neither `.` nor `:` is a Docker Hub namespace.
        assert_eq!(docker("myhost/app").registry(), "docker.io");
    }

    #[test]
    fn loopback_registries_are_told_apart() {
        assert!(docker("127.0.0.1:5000/a").is_loopback());
        assert!(docker("127.8.9.1/a").is_loopback());
        assert!(docker("localhost:5000/a").is_loopback());
        assert!(docker("[::1]:5000/a").is_loopback());
        assert!(!docker("10.0.0.1:5000/a").is_loopback());
        assert!(!docker("python").is_loopback());
    }

    #[test]
    fn transports_are_read() {
        let parse = |s: &str| ImageSource::parse(s).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(parse("docker://python"), ImageSource::Registry { name: docker("python"), registry_only: true });
        assert_eq!(parse("python"), ImageSource::Registry { name: docker("python"), registry_only: false });
        assert_eq!(parse("docker-daemon:app:v1"), ImageSource::Daemon(docker("app:v1")));
        assert_eq!(
            parse("oci:/srv/layout:v2"),
            ImageSource::OciDir { dir: "/srv/layout".into(), tag: Some("v2".into()) }
        );
        assert_eq!(parse("oci-archive:/a.tar"), ImageSource::OciArchive { file: "/a.tar".into(), tag: None });
        assert_eq!(
            parse("docker-archive:/a.tar"),
            ImageSource::DockerArchive { file: "/a.tar".into(), reference: None }
        );
        assert_eq!(parse("oci:/srv/layout:v2").canonical(), "oci:/srv/layout:v2");
        let relative = parse("oci:layout");
        let ImageSource::OciDir { dir, .. } = relative else { panic!("not an oci dir") };
        assert!(dir.is_absolute(), "{}", dir.display());
    }

    #[test]
    fn bad_references_are_refused_naming_them() {
        for bad in [
            "",
            "Python",
            "python:",
            "python:-x",
            "python@sha256:abc",
            "python@md5:0123",
            "a//b",
            "a/b_",
            "reg.io:99999/a",
            "docker://",
            "oci:",
            "oci:/x:",
            "a..b",
        ] {
            let err = ImageSource::parse(bad).err().unwrap_or_else(|| panic!("`{bad}` parsed"));
            assert!(matches!(err, ImageError::Parse { .. }), "{bad}: {err}");
            assert!(err.to_string().contains(&format!("`{bad}`")), "{err}");
        }
    }

    #[test]
    fn repository_components_follow_the_grammar() {
        for good in ["a", "a.b", "a_b", "a__b", "a---b", "0"] {
            assert!(component_ok(good.as_bytes()), "{good}");
        }
        for bad in ["", ".a", "a.", "a___b", "a._b", "a-", "a b"] {
            assert!(!component_ok(bad.as_bytes()), "{bad}");
        }
    }
}
