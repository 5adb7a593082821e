//! The languages `run_code` serves: where each one's code is written, and its compile and run
//! commands as SandboxFusion's runners (`sandbox/runners/major.py`, `minor.py`) give them, run
//! by `/bin/sh -c` in the call's working directory. Whether an image has a language is found
//! out once per image by a probe ([`probe_script`]) run in the first sandbox of that image.

/// How one language runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Lang {
    /// SandboxFusion's name for it.
    pub name: &'static str,
    /// The file the code is written to, in the working directory.
    pub file: &'static str,
    pub compile: Option<&'static str>,
    pub run: &'static str,
    /// A shell test that succeeds where the image can run it.
    pub probe: &'static str,
    /// What the image lacks when the probe fails, for the error.
    pub needs: &'static str,
}

/// Every language served. The rest of SandboxFusion's names (csharp, sql, cuda, D_ut, scala,
/// junit, kotlin_script, jest, verilog, python_gpu, lean, swift, racket, go_test, typescript)
/// need its own runtime files or toolchains set up in ways an unmodified image does not have;
/// a call in one answers `SandboxError` naming it.
pub const LANGS: &[Lang] = &[
    Lang {
        name: "python",
        file: "main.py",
        compile: None,
        run: "python3 main.py",
        probe: "command -v python3",
        needs: "python3",
    },
    Lang {
        name: "pytest",
        file: "test_main.py",
        compile: None,
        run: "python3 -m pytest test_main.py",
        probe: "python3 -c 'import pytest'",
        needs: "python3 with pytest",
    },
    Lang {
        name: "bash",
        file: "main.sh",
        compile: None,
        run: "/bin/bash main.sh",
        probe: "test -x /bin/bash",
        needs: "/bin/bash",
    },
    Lang {
        name: "cpp",
        file: "main.cpp",
        compile: Some("g++ -std=c++17 main.cpp -o test"),
        run: "./test",
        probe: "command -v g++",
        needs: "g++",
    },
    Lang {
        name: "go",
        file: "main.go",
        compile: Some("go build -o out main.go"),
        run: "./out",
        probe: "command -v go",
        needs: "go",
    },
    Lang {
        name: "java",
        file: "Main.java",
        compile: Some("javac -cp . Main.java"),
        run: "java -cp . -ea Main",
        probe: "command -v javac && command -v java",
        needs: "javac and java",
    },
    Lang {
        name: "nodejs",
        file: "main.js",
        compile: None,
        run: "node main.js",
        probe: "command -v node",
        needs: "node",
    },
    Lang {
        name: "rust",
        file: "main.rs",
        compile: Some("rustc main.rs -o test"),
        run: "./test",
        probe: "command -v rustc",
        needs: "rustc",
    },
    Lang {
        name: "php",
        file: "main.php",
        compile: None,
        run: "php -f main.php",
        probe: "command -v php",
        needs: "php",
    },
    Lang { name: "lua", file: "main.lua", compile: None, run: "lua main.lua", probe: "command -v lua", needs: "lua" },
    Lang {
        name: "R",
        file: "main.R",
        compile: None,
        run: "Rscript main.R",
        probe: "command -v Rscript",
        needs: "Rscript",
    },
    Lang { name: "perl", file: "main.pl", compile: None, run: "perl main.pl", probe: "command -v perl", needs: "perl" },
    Lang { name: "ruby", file: "main.rb", compile: None, run: "ruby main.rb", probe: "command -v ruby", needs: "ruby" },
    Lang {
        name: "julia",
        file: "main.jl",
        compile: None,
        run: "julia main.jl",
        probe: "command -v julia",
        needs: "julia",
    },
];

/// The name the Jupyter driver is probed under (not a `run_code` language).
pub const JUPYTER: &str = "jupyter";
/// The probe of a Python kernel for `run_jupyter`.
pub const JUPYTER_PROBE: &str = "python3 -c 'import jupyter_client, ipykernel'";

pub fn find(name: &str) -> Option<&'static Lang> {
    LANGS.iter().find(|l| l.name == name)
}

/// A shell script that prints, one a line, the name of every language the image can run (and
/// `jupyter` when it has a Python kernel).
pub fn probe_script() -> String {
    let mut s = String::new();
    for l in LANGS {
        s.push_str(&format!("if {{ {}; }} >/dev/null 2>&1; then echo {}; fi\n", l.probe, l.name));
    }
    s.push_str(&format!("if {{ {JUPYTER_PROBE}; }} >/dev/null 2>&1; then echo {JUPYTER}; fi\n"));
    s
}

/// PHP code as SandboxFusion runs it: with an opening tag added where it has none.
pub fn code_for(lang: &Lang, code: &str) -> String {
    if lang.name == "php" && !code.contains("<?php") {
        return format!("<?php\n{code}");
    }
    code.to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_served_language_is_one_of_sandboxfusions() {
        for l in LANGS {
            assert!(super::super::model::LANGUAGES.contains(&l.name), "{}", l.name);
        }
    }

    #[test]
    fn the_probe_names_what_this_shell_has() {
        let out = std::process::Command::new("/bin/sh")
            .arg("-c")
            .arg(probe_script())
            .output()
            .unwrap_or_else(|e| panic!("{e}"));
        let found = String::from_utf8_lossy(&out.stdout);
        // Every machine that runs the tests has /bin/bash (the test script runs in it).
        assert!(found.lines().any(|l| l == "bash"), "{found}");
        assert!(found.lines().all(|l| find(l).is_some() || l == JUPYTER), "{found}");
    }

    #[test]
    fn php_gets_its_opening_tag_once() {
        let php = find("php").unwrap_or_else(|| panic!("php"));
        assert_eq!(code_for(php, "echo 1;"), "<?php\necho 1;");
        assert_eq!(code_for(php, "<?php echo 1;"), "<?php echo 1;");
        let py = find("python").unwrap_or_else(|| panic!("python"));
        assert_eq!(code_for(py, "print(1)"), "print(1)");
    }
}
