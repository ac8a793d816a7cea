//! Single-file read and write.

use std::fs::{self, OpenOptions};
use std::io::{self, Read};
use std::os::unix::fs::{FileTypeExt, OpenOptionsExt, PermissionsExt};
use std::path::Path;

use sandbox_protocol::Kind;
use sandbox_protocol::message::{Done, FilePut, PathRequest, code};

use crate::streams::StreamCtx;
use crate::transfer::Download;

/// Writes the upload to `req.path` through a temporary file renamed into place, so a reader never
/// sees half a file and a failed upload leaves the old file as it was.
pub fn put(mut ctx: StreamCtx, req: FilePut) {
    let Some(mut upload) = ctx.take_upload() else {
        return ctx.fail(code::BAD_STREAM, "file put has no upload");
    };
    let path = Path::new(&req.path);
    let result = (|| -> Result<u64, (&'static str, String)> {
        let (dir, name) = split_abs(path)?;
        let mode = req.mode.unwrap_or(0o644) & 0o7777;
        fs::create_dir_all(dir).map_err(|e| io_error(dir, e))?;
        let tmp = dir.join(format!(
            ".{}.sandbox-upload-{}",
            name.to_string_lossy(),
            ctx.id
        ));
        let copy = (|| {
            let mut f = OpenOptions::new()
                .write(true)
                .create(true)
                .truncate(true)
                .mode(mode)
                .open(&tmp)?;
            let n = io::copy(&mut upload, &mut f)?;
            f.set_permissions(fs::Permissions::from_mode(mode))?;
            fs::rename(&tmp, path)?;
            Ok::<u64, io::Error>(n)
        })();
        copy.map_err(|e| {
            let _ = fs::remove_file(&tmp);
            io_error(path, e)
        })
    })();
    match result {
        Ok(bytes) => {
            ctx.out
                .send_json(Kind::Done, ctx.id, &Done { entries: 1, bytes });
        }
        Err((code, msg)) => {
            let _ = upload.drain();
            ctx.fail(code, msg);
        }
    }
}

/// Sends the bytes of `req.path`.
pub fn get(ctx: StreamCtx, req: PathRequest) {
    let path = Path::new(&req.path);
    let result = (|| -> Result<(), (&'static str, String)> {
        split_abs(path)?;
        // Non-blocking open: a FIFO (or a device) would otherwise block this stream's thread
        // forever in open() or read(); only regular files are served.
        let mut f = OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_NONBLOCK)
            .open(path)
            .map_err(|e| io_error(path, e))?;
        let meta = f.metadata().map_err(|e| io_error(path, e))?;
        if meta.is_dir() {
            return Err((
                code::BAD_REQUEST,
                format!("{} is a directory; read it as an archive", path.display()),
            ));
        }
        // Regular files and block devices (a disk) end; a FIFO or socket may never, a character
        // device (/dev/zero) never does.
        if !meta.is_file() && !meta.file_type().is_block_device() {
            return Err((
                code::BAD_REQUEST,
                format!(
                    "{} is not a regular file (a FIFO, socket or character device); only regular files and block devices can be read",
                    path.display()
                ),
            ));
        }
        let mut dl = Download::new(ctx.out.clone(), ctx.id, Kind::Output, ctx.credit.clone());
        let mut buf = vec![0u8; sandbox_protocol::DATA_CHUNK];
        loop {
            let n = match f.read(&mut buf) {
                Ok(0) => break,
                Ok(n) => n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(io_error(path, e)),
            };
            dl.send_now(&buf[..n])
                .map_err(|e| (code::IO, e.to_string()))?;
        }
        dl.finish().map_err(|e| (code::IO, e.to_string()))?;
        Ok(())
    })();
    if let Err((code, msg)) = result {
        ctx.fail(code, msg);
    }
}

/// Parent directory and file name of an absolute path that names a file.
fn split_abs(path: &Path) -> Result<(&Path, &std::ffi::OsStr), (&'static str, String)> {
    if !path.is_absolute() {
        return Err((
            code::BAD_REQUEST,
            format!("path `{}` is not absolute", path.display()),
        ));
    }
    match (path.parent(), path.file_name()) {
        (Some(dir), Some(name)) => Ok((dir, name)),
        _ => Err((
            code::BAD_REQUEST,
            format!("path `{}` does not name a file", path.display()),
        )),
    }
}

/// An I/O error as an error code and a message naming the path.
pub fn io_error(path: &Path, e: io::Error) -> (&'static str, String) {
    let code = match e.kind() {
        io::ErrorKind::NotFound => code::NOT_FOUND,
        io::ErrorKind::StorageFull => code::NO_SPACE,
        _ if e.raw_os_error() == Some(libc::ENOSPC) || e.raw_os_error() == Some(libc::EDQUOT) => {
            code::NO_SPACE
        }
        _ => code::IO,
    };
    (code, format!("{}: {e}", path.display()))
}
