# shellcheck shell=bash
# Starts and stops a private PgBouncer in transaction pooling mode in front of
# the private PostgreSQL (scripts/lib/postgres.sh, sourced first), for the
# tests of combee behind a pooler (tests/it/pooler.rs). Any database name is
# passed through to the same-named database on that server, so a test's fresh
# database is reachable through it at once. It exports
# COMBEE_TEST_PGBOUNCER_URL (the `postgres` database through PgBouncer; a test
# swaps the database name). The server side is kept small on purpose
# (default_pool_size) so many client connections share few server connections.
# The configuration is PgBouncer's stock one otherwise: no
# ignore_startup_parameters, no server_reset_query_always.
# `ensure_pgbouncer` installs the Debian package where it may (root or CI).

ensure_pgbouncer() {
  command -v pgbouncer >/dev/null 2>&1 || [ -x /usr/sbin/pgbouncer ] && return 0
  if [ "$(id -u)" = 0 ] || [ -n "${CI:-}" ]; then
    local sudo=""
    [ "$(id -u)" = 0 ] || sudo="sudo"
    $sudo apt-get update && $sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y pgbouncer
  else
    echo "pgbouncer is missing: install it (Debian: apt-get install pgbouncer); the pooler tests skip without it" >&2
    return 1
  fi
}

_pgbouncer_bin() {
  command -v pgbouncer 2>/dev/null || { [ -x /usr/sbin/pgbouncer ] && echo /usr/sbin/pgbouncer; }
}

# start_private_pgbouncer DATABASE_URL: the server URL (postgres://user@host:port/db).
start_private_pgbouncer() {
  local server="$1" bin hostport host pgport port user userinfo password=""
  bin=$(_pgbouncer_bin) || { echo "scripts: pgbouncer is not installed" >&2; return 1; }
  hostport=${server#*@}
  hostport=${hostport%%/*}
  host=${hostport%:*}
  pgport=${hostport##*:}
  userinfo=${server#*://}
  userinfo=${userinfo%%@*}
  user=${userinfo%%:*}
  [ "$userinfo" = "$user" ] || password=" password=${userinfo#*:}"
  COMBEE_PGBOUNCER_DIR=$(mktemp -d /tmp/combee-pgbouncer.XXXXXX)
  chmod 755 "$COMBEE_PGBOUNCER_DIR"
  port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
  printf '"%s" ""\n' "$user" >"$COMBEE_PGBOUNCER_DIR/users.txt"
  touch "$COMBEE_PGBOUNCER_DIR/pgbouncer.ini"
  chmod 600 "$COMBEE_PGBOUNCER_DIR/pgbouncer.ini"
  cat >"$COMBEE_PGBOUNCER_DIR/pgbouncer.ini" <<EOF
[databases]
* = host=$host port=$pgport user=$user$password

[pgbouncer]
listen_addr = 127.0.0.1
listen_port = $port
unix_socket_dir =
auth_type = trust
auth_file = $COMBEE_PGBOUNCER_DIR/users.txt
admin_users = $user
pool_mode = transaction
default_pool_size = 8
max_client_conn = 2000
logfile = $COMBEE_PGBOUNCER_DIR/pgbouncer.log
pidfile = $COMBEE_PGBOUNCER_DIR/pgbouncer.pid
EOF
  # PgBouncer refuses to run as root: as root it runs as the postgres user.
  local as_user=()
  if [ "$(id -u)" = 0 ]; then
    chown -R postgres "$COMBEE_PGBOUNCER_DIR"
    as_user=(-u postgres)
  fi
  "$bin" -d "${as_user[@]}" "$COMBEE_PGBOUNCER_DIR/pgbouncer.ini" \
    || { cat "$COMBEE_PGBOUNCER_DIR/pgbouncer.log" >&2 2>/dev/null; return 1; }
  local i
  for i in $(seq 1 100); do
    if python3 -c "import socket; socket.create_connection(('127.0.0.1', $port), 0.2)" 2>/dev/null; then
      export COMBEE_PGBOUNCER_DIR
      export COMBEE_TEST_PGBOUNCER_URL="postgres://$user@127.0.0.1:$port/postgres"
      echo "scripts: private PgBouncer (transaction pooling) on port $port ($COMBEE_PGBOUNCER_DIR)" >&2
      return 0
    fi
    sleep 0.1
  done
  echo "scripts: PgBouncer did not listen on port $port" >&2
  cat "$COMBEE_PGBOUNCER_DIR/pgbouncer.log" >&2 2>/dev/null
  return 1
}

stop_private_pgbouncer() {
  [ -n "${COMBEE_PGBOUNCER_DIR:-}" ] || return 0
  if [ -f "$COMBEE_PGBOUNCER_DIR/pgbouncer.pid" ]; then
    kill "$(cat "$COMBEE_PGBOUNCER_DIR/pgbouncer.pid")" 2>/dev/null || true
  fi
  rm -rf "$COMBEE_PGBOUNCER_DIR"
}
