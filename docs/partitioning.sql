-- oes_orders and oes_order_events, hash-partitioned by user_id (PostgreSQL 11 or later;
-- tried on 15).
--
-- The same columns, checks, partial indexes and names as migrations 0001-0014, for a fresh
-- database; oes_event_cursors, oes_event_retries, oes_payment_refusals, oes_user_limits,
-- oes_user_limit_history, oes_pauses, oes_resources, oes_units, oes_waiting and
-- oes_alembic_version stay as the migrations make them (small, not partitioned); oes_holds
-- too, its foreign key to the orders being (order_id, user_id) as the events' is. The
-- service's statements run on it unchanged:
-- tests/integration/test_partitioning.py applies this file to a throwaway PostgreSQL and
-- runs create, pay, cancel, the sweep and the SQL guard against it. docs/capacity.md says
-- what it costs and what would change.
--
-- What partitioning forces:
--   * A unique index or primary key of a partitioned table must contain the partition key.
--     So the primary key of orders is (id, user_id), not id (id first, so a lookup by id
--     alone still uses it), and by itself it would let one caller-supplied order_id be
--     inserted once per user: tried, the service then created 40 orders "dup-1" for 40
--     users instead of raising OrderConflict. The oes_order_ids table below (partitioned by
--     id, primary key id) restores the rule: a trigger inserts each new order's id there,
--     a second user's insert of the same id fails, and the service sees the same
--     IntegrityError as on the plain schema. It is also the id -> user_id map a pay by id
--     would need to read one partition instead of all (docs/capacity.md).
--   * order_events is partitioned by the same key, so an order and its events live in
--     partitions with the same number, and its foreign key becomes (order_id, user_id) ->
--     orders (id, user_id), the events' user_id being the order's (the service writes both).
--     Its primary key is (id, user_id); ids still come from one sequence.
--   * The partial unique index on (user_id, slot) WHERE status = 'unpaid' contains the
--     partition key: it stays partial and unique, enforced in each partition (a user's
--     orders are all in one partition), and it is still the ON CONFLICT arbiter of a create.
--   * Every other partial index stays partial, per partition.
--
-- 16 partitions here: the count is chosen once (changing it means moving every row), a
-- power of two, so a later split of each partition in two (MODULUS 32) moves only the rows
-- of the one being split.

CREATE TABLE oes_orders (
    id varchar(128) NOT NULL,
    user_id varchar(512) NOT NULL,
    status varchar(16) NOT NULL,
    amount varchar(40),
    currency varchar(3),
    created_at_ms bigint NOT NULL,
    expires_at_ms bigint NOT NULL,
    updated_at_ms bigint NOT NULL,
    paid_at_ms bigint,
    closed_at_ms bigint,
    close_reason varchar(256),
    payment_ref varchar(256),
    metadata json,
    extensions integer DEFAULT 0 NOT NULL,
    slot integer,
    policy varchar(64),
    remind_at_ms bigint,
    reminded_at_ms bigint,
    holds json,
    CONSTRAINT pk_oes_orders PRIMARY KEY (id, user_id),
    CONSTRAINT ck_oes_orders_status CHECK (status IN ('unpaid', 'paid', 'cancelled', 'closed')),
    CONSTRAINT ck_oes_orders_expiry_after_creation CHECK (expires_at_ms > created_at_ms)
) PARTITION BY HASH (user_id);

CREATE TABLE oes_order_events (
    id bigserial NOT NULL,
    order_id varchar(128) NOT NULL,
    user_id varchar(512) NOT NULL,
    kind varchar(16) NOT NULL,
    at_ms bigint NOT NULL,
    data json,
    actor_kind varchar(16),
    actor varchar(128),
    txid bigint DEFAULT txid_current(),
    CONSTRAINT pk_oes_order_events PRIMARY KEY (id, user_id),
    CONSTRAINT ck_oes_order_events_kind
        CHECK (kind IN ('created', 'paid', 'cancelled', 'closed', 'extended',
                        'payment_refused', 'requeued', 'discarded', 'expiring', 'erased')),
    CONSTRAINT fk_oes_order_events_order_id_oes_orders FOREIGN KEY (order_id, user_id)
        REFERENCES oes_orders (id, user_id) ON DELETE CASCADE
) PARTITION BY HASH (user_id);

DO $$
BEGIN
    FOR r IN 0..15 LOOP
        EXECUTE format(
            'CREATE TABLE oes_orders_p%s PARTITION OF oes_orders '
            'FOR VALUES WITH (MODULUS 16, REMAINDER %s)',
            lpad(r::text, 2, '0'), r);
        EXECUTE format(
            'CREATE TABLE oes_order_events_p%s PARTITION OF oes_order_events '
            'FOR VALUES WITH (MODULUS 16, REMAINDER %s)',
            lpad(r::text, 2, '0'), r);
    END LOOP;
END
$$;

-- One row per order id, whatever its user: the uniqueness of ids across users.
CREATE TABLE oes_order_ids (
    id varchar(128) NOT NULL,
    user_id varchar(512) NOT NULL,
    CONSTRAINT pk_oes_order_ids PRIMARY KEY (id)
) PARTITION BY HASH (id);

CREATE FUNCTION oes_orders_keep_order_ids() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP = 'INSERT' THEN
        INSERT INTO oes_order_ids (id, user_id) VALUES (NEW.id, NEW.user_id);
        RETURN NEW;
    END IF;
    DELETE FROM oes_order_ids WHERE id = OLD.id AND user_id = OLD.user_id;
    RETURN OLD;
END
$$;

CREATE TRIGGER oes_orders_keep_order_ids AFTER INSERT OR DELETE ON oes_orders
    FOR EACH ROW EXECUTE FUNCTION oes_orders_keep_order_ids();

DO $$
BEGIN
    FOR r IN 0..15 LOOP
        EXECUTE format(
            'CREATE TABLE oes_order_ids_p%s PARTITION OF oes_order_ids '
            'FOR VALUES WITH (MODULUS 16, REMAINDER %s)',
            lpad(r::text, 2, '0'), r);
    END LOOP;
END
$$;

-- Created on the parent, each index is created on every partition (and on partitions
-- attached later). The status tests are the same inline literals as the migrations', so
-- the planner can prove them for the service's statements.
CREATE INDEX ix_oes_orders_unpaid_expires_at_ms ON oes_orders (expires_at_ms)
    WHERE status = 'unpaid';
CREATE INDEX ix_oes_orders_unpaid_user_id_expires_at_ms ON oes_orders (user_id, expires_at_ms)
    WHERE status = 'unpaid';
CREATE UNIQUE INDEX ix_oes_orders_unpaid_user_id_slot ON oes_orders (user_id, slot)
    WHERE status = 'unpaid';
CREATE INDEX ix_oes_orders_reminder_due_remind_at_ms ON oes_orders (remind_at_ms)
    WHERE status = 'unpaid' AND remind_at_ms IS NOT NULL;
CREATE INDEX ix_oes_orders_reminded_reminded_at_ms ON oes_orders (reminded_at_ms)
    WHERE reminded_at_ms IS NOT NULL;
CREATE INDEX ix_oes_orders_paid_paid_at_ms ON oes_orders (paid_at_ms)
    WHERE status = 'paid';
CREATE INDEX ix_oes_orders_cancelled_closed_at_ms ON oes_orders (closed_at_ms)
    WHERE status = 'cancelled';
CREATE INDEX ix_oes_orders_closed_closed_at_ms_expires_at_ms ON oes_orders (closed_at_ms, expires_at_ms)
    WHERE status = 'closed';
CREATE INDEX ix_oes_order_events_order_id ON oes_order_events (order_id);
CREATE INDEX ix_oes_order_events_txid_id ON oes_order_events (txid, id);

-- The rest of the schema as migrations 0003, 0004, 0008 and 0009 leave it (the refusals' foreign
-- key is (order_id, user_id), as the events'), and the revision stamp, so
-- `orders db current` and the service's schema check see a database at head.
CREATE TABLE oes_event_cursors (
    name varchar(64) NOT NULL,
    txid bigint NOT NULL,
    event_id bigint NOT NULL,
    updated_at_ms bigint NOT NULL,
    CONSTRAINT pk_oes_event_cursors PRIMARY KEY (name)
);
CREATE TABLE oes_event_retries (
    consumer varchar(64) NOT NULL,
    event_id bigint NOT NULL,
    attempts integer NOT NULL,
    next_at_ms bigint NOT NULL,
    last_error varchar(256),
    parked_at_ms bigint,
    CONSTRAINT pk_oes_event_retries PRIMARY KEY (consumer, event_id)
);
CREATE INDEX ix_oes_event_retries_retrying_consumer_next_at_ms ON oes_event_retries (consumer, next_at_ms)
    WHERE parked_at_ms IS NULL;
CREATE TABLE oes_payment_refusals (
    order_id varchar(128) NOT NULL,
    payment_ref varchar(256) NOT NULL,
    user_id varchar(512),
    reason varchar(32) NOT NULL,
    amount varchar(40),
    currency varchar(3),
    refused_at_ms bigint NOT NULL,
    event_id bigint,
    handled_at_ms bigint,
    handled_by_kind varchar(16),
    handled_by varchar(128),
    CONSTRAINT pk_oes_payment_refusals PRIMARY KEY (order_id, payment_ref)
);
CREATE INDEX ix_oes_payment_refusals_refused_at_ms ON oes_payment_refusals (refused_at_ms);
CREATE INDEX ix_oes_payment_refusals_pending_refused_at_ms ON oes_payment_refusals (refused_at_ms)
    WHERE handled_at_ms IS NULL;
CREATE TABLE oes_user_limits (
    user_id varchar(512) NOT NULL,
    unpaid_limit integer NOT NULL,
    updated_at_ms bigint NOT NULL,
    actor_kind varchar(16),
    actor varchar(128),
    CONSTRAINT pk_oes_user_limits PRIMARY KEY (user_id),
    CONSTRAINT ck_oes_user_limits_unpaid_limit_range
        CHECK (unpaid_limit >= 0 AND unpaid_limit <= 1000000)
);
CREATE TABLE oes_user_limit_history (
    id bigserial NOT NULL,
    user_id varchar(512) NOT NULL,
    unpaid_limit integer,
    changed_at_ms bigint NOT NULL,
    actor_kind varchar(16),
    actor varchar(128),
    CONSTRAINT pk_oes_user_limit_history PRIMARY KEY (id)
);
CREATE INDEX ix_oes_user_limit_history_user_id_id ON oes_user_limit_history (user_id, id);
CREATE TABLE oes_pauses (
    id bigserial NOT NULL,
    reason varchar(256) NOT NULL,
    started_at_ms bigint NOT NULL,
    actor_kind varchar(16),
    actor varchar(128),
    open_marker boolean,
    resumed_at_ms bigint,
    resumed_actor_kind varchar(16),
    resumed_actor varchar(128),
    shift_cursor varchar(128),
    shifted bigint NOT NULL,
    ended_at_ms bigint,
    CONSTRAINT pk_oes_pauses PRIMARY KEY (id),
    CONSTRAINT uq_oes_pauses_open_marker UNIQUE (open_marker)
);
CREATE TABLE oes_resources (
    id varchar(128) NOT NULL,
    capacity bigint NOT NULL,
    per_user bigint,
    held bigint DEFAULT 0 NOT NULL,
    sold bigint DEFAULT 0 NOT NULL,
    updated_at_ms bigint NOT NULL,
    updated_by_kind varchar(16),
    updated_by varchar(128),
    named boolean DEFAULT false NOT NULL,
    CONSTRAINT pk_oes_resources PRIMARY KEY (id),
    CONSTRAINT ck_oes_resources_capacity CHECK (capacity >= 0),
    CONSTRAINT ck_oes_resources_held CHECK (held >= 0),
    CONSTRAINT ck_oes_resources_sold CHECK (sold >= 0)
);
CREATE TABLE oes_holds (
    order_id varchar(128) NOT NULL,
    resource_id varchar(128) NOT NULL,
    user_id varchar(512) NOT NULL,
    quantity bigint NOT NULL,
    status varchar(16) NOT NULL,
    CONSTRAINT pk_oes_holds PRIMARY KEY (order_id, resource_id),
    CONSTRAINT ck_oes_holds_status CHECK (status IN ('held', 'sold', 'released')),
    CONSTRAINT ck_oes_holds_quantity CHECK (quantity > 0),
    CONSTRAINT fk_oes_holds_order_id_oes_orders FOREIGN KEY (order_id, user_id)
        REFERENCES oes_orders (id, user_id) ON DELETE CASCADE,
    CONSTRAINT fk_oes_holds_resource_id_oes_resources FOREIGN KEY (resource_id)
        REFERENCES oes_resources (id)
);
CREATE INDEX ix_oes_holds_held_resource_id ON oes_holds (resource_id, quantity)
    WHERE status = 'held';
CREATE INDEX ix_oes_holds_resource_id_user_id ON oes_holds (resource_id, user_id);
CREATE TABLE oes_units (
    resource_id varchar(128) NOT NULL,
    name varchar(64) NOT NULL,
    position bigint NOT NULL,
    state varchar(8) NOT NULL,
    order_id varchar(128),
    CONSTRAINT pk_oes_units PRIMARY KEY (resource_id, name),
    CONSTRAINT ck_oes_units_state CHECK (state IN ('free', 'held', 'sold')),
    CONSTRAINT fk_oes_units_resource_id_oes_resources FOREIGN KEY (resource_id)
        REFERENCES oes_resources (id)
);
CREATE INDEX ix_oes_units_resource_id_state_position ON oes_units (resource_id, state, position);
CREATE INDEX ix_oes_units_order_id ON oes_units (order_id);
CREATE TABLE oes_waiting (
    id bigserial NOT NULL,
    resource_id varchar(128) NOT NULL,
    user_id varchar(512) NOT NULL,
    quantity bigint NOT NULL,
    until_ms bigint,
    created_at_ms bigint NOT NULL,
    status varchar(16) NOT NULL,
    order_id varchar(128),
    ended_at_ms bigint,
    added_by_kind varchar(16),
    added_by varchar(128),
    CONSTRAINT pk_oes_waiting PRIMARY KEY (id),
    CONSTRAINT ck_oes_waiting_status CHECK (status IN ('waiting', 'served', 'left', 'expired')),
    CONSTRAINT ck_oes_waiting_quantity CHECK (quantity > 0),
    CONSTRAINT fk_oes_waiting_resource_id_oes_resources FOREIGN KEY (resource_id)
        REFERENCES oes_resources (id)
);
CREATE UNIQUE INDEX ix_oes_waiting_resource_id_user_id ON oes_waiting (resource_id, user_id)
    WHERE status = 'waiting';
CREATE INDEX ix_oes_waiting_queue ON oes_waiting (resource_id, id) WHERE status = 'waiting';
CREATE INDEX ix_oes_waiting_user_id ON oes_waiting (user_id);
CREATE TABLE oes_alembic_version (
    version_num varchar(32) NOT NULL,
    CONSTRAINT oes_alembic_version_pkc PRIMARY KEY (version_num)
);
INSERT INTO oes_alembic_version (version_num) VALUES ('0014');
