//! `images [ls|rm|prune]`: the process provider's image store. Pulling ahead is `prepare`.

use std::process::ExitCode;

use sandman_client::Client;
use sandman_wire::server::ImagesRemoved;

use crate::cli::{ImagesAction, ImagesCmd};
use crate::format::{self, age, bytes, table};
use crate::report::{self, outln};

pub async fn images(client: &Client, cmd: ImagesCmd) -> anyhow::Result<ExitCode> {
    match cmd.action.unwrap_or(ImagesAction::Ls) {
        ImagesAction::Ls => {
            let list = client.images().await?;
            if cmd.json {
                outln!("{}", format::json(&list)?)?;
                return Ok(ExitCode::SUCCESS);
            }
            let now = format::now_ms();
            let rows: Vec<Vec<String>> = list
                .images
                .iter()
                .map(|i| {
                    let name = i.references.first().cloned().unwrap_or_else(|| "<none>".into());
                    let id = i.id.trim_start_matches("sha256:").chars().take(12).collect();
                    vec![
                        name,
                        id,
                        bytes(i.size),
                        i.layers.to_string(),
                        i.sandboxes.to_string(),
                        age(i.last_used_ms, now),
                    ]
                })
                .collect();
            outln!("{}", table(&["IMAGE", "ID", "SIZE", "LAYERS", "SANDBOXES", "USED"], &rows).trim_end())?;
            let bound = list.max_size.map_or_else(|| "no bound".to_string(), |m| format!("of {}", bytes(m)));
            outln!("store: {} ({bound})", bytes(list.size))?;
        }
        ImagesAction::Rm { images } => {
            let mut worst = 0u8;
            for image in &images {
                match client.remove_image(image).await {
                    Ok(removed) => said(&removed, cmd.json)?,
                    // As with `sandman rm`, removing what is not there is a clean "no".
                    Err(err) => {
                        let err = anyhow::Error::new(err);
                        report::error(&err);
                        worst = worst.max(if report::is_gone(&err) { report::NO } else { 2 });
                    }
                }
            }
            return Ok(ExitCode::from(worst));
        }
        ImagesAction::Prune => said(&client.prune_images().await?, cmd.json)?,
    }
    Ok(ExitCode::SUCCESS)
}

/// What was removed: one line per image, then the bytes freed.
fn said(removed: &ImagesRemoved, json: bool) -> anyhow::Result<()> {
    if json {
        outln!("{}", format::json(removed)?)?;
        return Ok(());
    }
    if let Some(reference) = &removed.untagged {
        outln!("untagged {reference}")?;
    }
    for id in &removed.images {
        outln!("removed {id}")?;
    }
    outln!("freed {}", bytes(removed.freed))?;
    Ok(())
}
