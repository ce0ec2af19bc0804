-- The outside world in its default shapes (DESIGN §4), for the demo and the tests.


-- name: seed_create_helpdesk
-- The help desk's ticket mirror.
CREATE SCHEMA IF NOT EXISTS helpdesk;
CREATE TABLE IF NOT EXISTS helpdesk.tickets (
    id text PRIMARY KEY,
    requester_email text,
    tenant text,
    created_at timestamptz NOT NULL DEFAULT now(),
    updated_at timestamptz NOT NULL DEFAULT now()
);
-- what the sweeper's refresh schedule walks (recently updated tickets, a page at a time)
CREATE INDEX IF NOT EXISTS tickets_updated_at_id_idx ON helpdesk.tickets (updated_at, id);


-- name: seed_create_warehouse
-- The warehouse's customers and orders.
CREATE SCHEMA IF NOT EXISTS warehouse;
CREATE TABLE IF NOT EXISTS warehouse.customers (customer_id text PRIMARY KEY, email text NOT NULL);
CREATE INDEX IF NOT EXISTS customers_email_idx ON warehouse.customers (lower(email));
CREATE TABLE IF NOT EXISTS warehouse.orders (
    order_id text PRIMARY KEY,
    customer_id text NOT NULL,
    placed_at timestamptz NOT NULL,
    total numeric(12, 2) NOT NULL
);
CREATE INDEX IF NOT EXISTS orders_customer_idx ON warehouse.orders (customer_id);


-- name: seed_create_legacy
-- What the legacy flow wrote.
CREATE SCHEMA IF NOT EXISTS legacy;
CREATE TABLE IF NOT EXISTS legacy.ticket_orders (
    ticket_id text NOT NULL,
    order_id text NOT NULL,
    looked_up_at timestamptz NOT NULL,
    PRIMARY KEY (ticket_id, order_id)
);


-- name: seed_insert_customers
-- One customer.
INSERT INTO warehouse.customers (customer_id, email) VALUES (:customer_id, :email)
ON CONFLICT DO NOTHING;


-- name: seed_insert_orders
-- One order.
INSERT INTO warehouse.orders (order_id, customer_id, placed_at, total)
VALUES (:order_id, :customer_id, :placed_at, :total)
ON CONFLICT DO NOTHING;


-- name: seed_insert_tickets
-- One mirrored ticket.
INSERT INTO helpdesk.tickets (id, requester_email, tenant, created_at, updated_at)
VALUES (:id, :requester_email, :tenant, :created_at, :updated_at)
ON CONFLICT DO NOTHING;


-- name: seed_insert_legacy
-- One row of the legacy output.
INSERT INTO legacy.ticket_orders (ticket_id, order_id, looked_up_at)
VALUES (:ticket_id, :order_id, :looked_up_at)
ON CONFLICT DO NOTHING;


-- name: seed_select_customers
-- Every warehouse customer (to seed another warehouse with the same rows).
SELECT customer_id, email FROM warehouse.customers ORDER BY customer_id;


-- name: seed_select_orders
-- Every warehouse order (to seed another warehouse with the same rows).
SELECT order_id, customer_id, placed_at, total FROM warehouse.orders ORDER BY order_id;
