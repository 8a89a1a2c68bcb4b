//! `combee members`: people's explicit grants, managed directly in the store
//! (as `/v1/members` and the web UI's members page do over HTTP); each change
//! is audited as the OS user running the command.

use clap::Subcommand;

use crate::{
    app,
    config::Settings,
    domain::access::Reach,
    domain::{
        access::Role,
        audit::{NewAuditEntry, RequestOrigin},
        people::{Grant, Member},
    },
    service::{self, ServiceError, people},
};

#[derive(Debug, Subcommand)]
pub enum MembersCommand {
    /// List the members and their grants.
    List,
    /// Give a person (the provider's subject, or an email address) a role in a project or
    /// server-wide, replacing their grant there (a person may hold one in each project).
    Set {
        subject: String,
        /// The project the role holds in; left out: every project.
        #[arg(long)]
        project: Option<String>,
        /// viewer, operator or admin.
        #[arg(long)]
        role: String,
    },
    /// Take a person's explicit grants away: the one in `--project`, else every one.
    Remove {
        subject: String,
        /// Only the grant in this project.
        #[arg(long)]
        project: Option<String>,
    },
}

fn entry(action: &str, subject: &str, before: Option<&Member>, after: Option<&Member>) -> NewAuditEntry {
    let value = |m: Option<&Member>| m.and_then(|m| serde_json::to_value(m).ok());
    NewAuditEntry::new(
        service::audit::cli_actor(),
        RequestOrigin::default(),
        action,
        Some("member".into()),
        Some(subject.to_owned()),
        value(before),
        value(after),
    )
}

pub async fn run(settings: Settings, cmd: MembersCommand) -> anyhow::Result<()> {
    let st = service::AppState::build(app::open_store(&settings).await?, settings);
    match cmd {
        MembersCommand::List => {
            println!("{:<40} {:<20} {:<9} CHANGED", "SUBJECT", "PROJECT", "ROLE");
            for m in people::list_members(&st, &Reach::Server).await? {
                let project = m.project.as_deref().unwrap_or("(every project)");
                println!("{:<40} {:<20} {:<9} {}", m.subject, project, m.role.as_str(), m.updated_at.to_rfc3339());
            }
        }
        MembersCommand::Set { subject, project, role } => {
            let role = Role::parse(role.trim())
                .ok_or_else(|| anyhow::anyhow!("unknown role {role:?}: viewer, operator or admin"))?;
            let (member, before) =
                match people::set_member(&st, &Reach::Server, &subject, project.as_deref(), role).await {
                    Err(ServiceError::Unprocessable(why) | ServiceError::NotFound(why)) => anyhow::bail!("{why}"),
                    other => other?,
                };
            service::audit::record_entry(&st, &entry("member.set", &subject, before.as_ref(), Some(&member))).await;
            println!(
                "{} is {} {}",
                member.subject,
                member.role.as_str(),
                match &member.project {
                    Some(p) => format!("in {p}"),
                    None => "on the whole server".into(),
                }
            );
        }
        MembersCommand::Remove { subject, project } => {
            let removed = match people::remove_member(&st, &Reach::Server, &subject, project.as_deref()).await {
                Err(ServiceError::NotFound(_)) => anyhow::bail!("no member {subject:?}"),
                other => other?,
            };
            for before in &removed {
                service::audit::record_entry(&st, &entry("member.remove", &subject, Some(before), None)).await;
                println!(
                    "removed {subject}: {}",
                    Grant { project: before.project.clone(), role: before.role }.describe()
                );
            }
        }
    }
    Ok(())
}
