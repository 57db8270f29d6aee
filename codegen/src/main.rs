//! `cargo run -p codegen -- --dump DIR`: write the generated kernel sources into DIR for reading.

use std::path::PathBuf;

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let dir = match args.as_slice() {
        [flag, dir] if flag == "--dump" => PathBuf::from(dir),
        _ => {
            eprintln!("usage: codegen --dump DIR");
            std::process::exit(2);
        }
    };
    if let Err(e) = std::fs::create_dir_all(&dir) {
        eprintln!("codegen: cannot create {}: {e}", dir.display());
        std::process::exit(1);
    }
    for g in codegen::generate() {
        let path = dir.join(g.file);
        if let Err(e) = std::fs::write(&path, g.source) {
            eprintln!("codegen: cannot write {}: {e}", path.display());
            std::process::exit(1);
        }
        println!("{}", path.display());
    }
}
